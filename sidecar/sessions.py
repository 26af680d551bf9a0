"""Sessions: decoded client messages in, replies out (``out``), through one table from message type to handler.

Sans-IO: takes ``(identity, frames)`` and leaves ``Outbound`` messages in ``out`` (``replies.Outbox``); never touches
a socket or the model. Each responsibility is a part of its own, and this module only wires them and routes:
- ``clients.ClientDirectory``: handshakes, session owners, liveness;
- ``stream_table.StreamTable``: open streams, their slots, closing and freeing;
- ``chunk_flow.ChunkFlow``: chunks queued, completed or failed (commit after success);
- ``ipc.regions.RegionService``: CUDA IPC regions.
Every failure is a typed error scoped to the message or chunk that caused it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from code2wav import proto
from code2wav.proto import ErrorCode, ProtocolError

from .chunk_flow import ChunkFlow
from .chunk_trace import ChunkTrace
from .clients import ClientDirectory, WelcomeTerms
from .config import ServerConfig
from .ipc.device import CudaIpcDevice
from .ipc.regions import RegionService
from .metrics import Metrics
from .models import LoadedModel
from .reaping import plan_reap
from .replies import Outbox
from .scheduler import Scheduler
from .state_store import StateArena
from .stream_table import CLOSE_SLICE_STREAMS, StreamTable
from .welcome import model_entry

log = logging.getLogger(__name__)

STEP_AVERAGE_WEIGHT = 0.2
"""Weight of the newest step in ``Load.step_s`` (an exponential average: about the last five steps)."""

Handler = Callable[[bytes, Any, list], None]
"""``(identity, message, frames)``: what a message of a session's client does (its owner checked already)."""


class Sessions:
    def __init__(self, cfg: ServerConfig, model: LoadedModel, arena: StateArena, scheduler: Scheduler,
                 metrics: Metrics, ipc_device: CudaIpcDevice | None = None, host_id: str | None = None,
                 ipc_off_reason: str = "not configured", clock: Callable[[], float] = time.monotonic,
                 trace: ChunkTrace | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.scheduler = scheduler
        lim = cfg.limits
        self.limits = proto.Limits(max_message_bytes=lim.max_message_bytes, max_chunk_frames=lim.max_chunk_frames,
                                   max_chunks_per_message=lim.max_chunks_per_message,
                                   max_left_context_frames=lim.max_left_context_frames)
        self.out = Outbox(metrics)
        self.clients: ClientDirectory | None = None  # (set below; regions look sessions up through it)
        self.regions = RegionService(ipc_device, host_id, metrics, self.out.send, self.out.error, ipc_off_reason,
                                     session_of=lambda identity: self.clients.get(identity))
        capabilities = {**self.regions.capabilities(), "load": proto.LOAD_VERSION, "early_audio": True}
        terms = WelcomeTerms(models=(model_entry(model),), default_model=model.name, limits=self.limits,
                             heartbeat_interval_s=cfg.heartbeat_interval_s, capabilities=capabilities)
        self.clients = ClientDirectory(terms, self.out, metrics, clock)
        self.clients.load_now = self.load
        self.refusing_streams = False  # the drain grace (``stop_opening``): open streams are still served
        self.recent_step_s = 0.0  # Load.step_s: an exponential average of the engine steps' durations
        self.streams = StreamTable(model, arena, scheduler, self.out, metrics, self.regions.release, clock)
        self.chunks = ChunkFlow(model, self.streams, scheduler, self.regions, self.out, metrics,
                                lim.max_pending_chunks_per_client, clock, trace)
        self.handlers: dict[type, Handler] = {
            proto.Ping: lambda identity, msg, frames: self.out.send(
                identity, proto.Pong(request_id=msg.request_id, boot_epoch=self.clients.boot_epoch, load=self.load())),
            proto.OpenStream: self._open,
            proto.Decode: self.chunks.decode,  # (identity, msg, frames): called as it is, on the hot path
            proto.Finish: lambda identity, msg, frames: self.streams.finish(identity, msg),
            proto.Abort: lambda identity, msg, frames: self.streams.abort(identity, msg),
            proto.Bye: lambda identity, msg, frames: self.drop_client(identity, "bye"),
            proto.RegisterRegion: lambda identity, msg, frames: self.regions.on_register(identity, msg),
            proto.UnregisterRegion: lambda identity, msg, frames: self.regions.on_unregister(identity, msg),
        }

    @property
    def draining(self) -> bool:
        """New streams are refused (the drain grace, then the drain): what the load reports."""
        return self.refusing_streams or self.chunks.draining

    def load(self) -> proto.Load:
        """The load a ``pong`` and a ``welcome`` report (``proto.Load``): what a client pool places streams by."""
        streams, arena = self.streams, self.streams.arena
        return proto.Load(open_streams=len(streams.streams), free_slots=arena.num_slots - arena.num_used,
                          queued_chunks=sum(streams.pending_by_client.values()), step_s=self.recent_step_s,
                          draining=self.draining)

    def note_step(self, seconds: float) -> None:
        """An engine step took ``seconds``: folded into ``Load.step_s``."""
        previous = self.recent_step_s
        self.recent_step_s = seconds if previous == 0.0 else previous + STEP_AVERAGE_WEIGHT * (seconds - previous)

    def stop_opening(self) -> None:
        """The drain grace starts: new streams are refused (``unavailable``) and the load says ``draining``, while the
        open ones are still served, so client pools move them elsewhere (``drain_grace_s``)."""
        self.refusing_streams = True

    def drain(self) -> None:
        """The server is stopping: new streams and chunks are refused; queued ones run now, without waiting for
        company."""
        self.chunks.draining = True
        self.scheduler.draining = True

    def on_message(self, identity: bytes, frames: list, user_id: str | None = None) -> None:
        try:
            msg = proto.decode_client_message(frames, self.limits)
        except ProtocolError as exc:
            return self.out.error(identity, exc.request_id, exc.code, exc.message)
        if isinstance(msg, proto.Hello):
            return self.clients.hello(identity, msg, user_id, self.drop_client)
        session = self.clients.get(identity)
        if session is None:
            return self.out.error(identity, msg.request_id, ErrorCode.INVALID_ARGUMENT,
                                  f"{msg.TYPE} before the handshake: send hello first")
        if self.clients.may_act(identity, session, msg.request_id, user_id):
            self.handlers[type(msg)](identity, msg, frames)

    def _open(self, identity: bytes, msg: proto.OpenStream, frames: list) -> None:
        if self.draining:
            return self.out.error(identity, msg.request_id, ErrorCode.UNAVAILABLE, "the sidecar is shutting down")
        self.streams.open(identity, msg, self.cfg.limits.max_streams_per_client)

    def drop_client(self, identity: bytes, reason: str) -> None:
        """Forget a client (bye, re-handshake, silence): its streams are detached now and freed in slices."""
        num_streams = self.streams.detach_all(identity, reason)
        if self.clients.remove(identity, reason, num_streams) is None:
            return
        if num_streams > CLOSE_SLICE_STREAMS:
            log.info("a client left (%s) with %d open streams: freeing them in slices of %d", reason, num_streams,
                     CLOSE_SLICE_STREAMS)
        self.streams.close_some()
        self.regions.drop_client(identity)

    def reap(self, now_s: float) -> int:
        """Free what ``reaping.plan_reap`` names (streams idle past the TTL; clients silent past
        ``client_silence_s``, with their streams), in slices. Returns the streams reaped for idleness."""
        ttl, silence_s = self.cfg.streams.ttl_s, self.cfg.streams.client_silence_s
        plan = plan_reap(self.streams.streams, self.clients.sessions, now_s, ttl, silence_s,
                         busy=self.streams.pending_by_client)
        self.streams.reap_idle(plan.idle_streams)
        num_client_streams = sum(self.streams.num_open(identity) for identity in plan.gone_clients)
        for identity in plan.gone_clients:
            self.drop_client(identity, reason="silent")
        if plan:  # one summary line, not one per stream
            oldest_s = max((now_s - s.last_active_s for s in plan.idle_streams), default=0.0)
            log.info("reaping %d streams idle past the TTL (%.0fs; longest idle %.1fs); forgetting %d clients silent "
                     "for over %.0fs, with their %d other streams", len(plan.idle_streams), ttl, oldest_s,
                     len(plan.gone_clients), min(silence_s, ttl), num_client_streams)
        self.streams.close_some()
        return len(plan.idle_streams)
