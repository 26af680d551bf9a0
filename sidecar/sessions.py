"""Sessions: turn decoded client messages into stream operations and engine jobs; collect replies.

Sans-IO: takes ``(identity, frames)`` in, leaves ``Outbound`` messages in ``out`` (``replies.Outbox``); never
touches a socket or the model. Every failure is a typed error scoped to the message or chunk that caused it.

Over 300 lines: the per-connection stream state machine (open, decode, commit after success, fail, close, reap)
kept in one place so its commit rules read in one sitting; what to reap is decided in ``reaping.py``, the
welcome's model entry is built in ``welcome.py``, and what goes out is collected by ``replies.Outbox``.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from code2wav import proto
from code2wav.proto import ErrorCode, ProtocolError

from .auth import SessionOwners, new_session_secret
from .config import ServerConfig
from .connlog import ConnLog
from .inputs import read_chunk_inputs
from .ipc.device import CudaIpcDevice
from .ipc.regions import RegionService
from .metrics import Metrics
from .models import FamilyError, LoadedModel
from .modes import get_mode
from .reaping import plan_reap
from .replies import Outbox, PendingReply
from .welcome import model_entry
from .scheduler import ChunkJob, Scheduler
from .state_store import ArenaFull, StateArena
from .streams import SeqVerdict, ServedStream, check_seq, is_repeat_open
from .work import ChunkRejected, DecodeItem

log = logging.getLogger(__name__)


CLOSE_SLICE_STREAMS = 512
"""Streams freed per loop turn when a client with many streams leaves (bye, re-handshake, TTL): the rest wait in
``close_backlog`` so pings of other clients are answered in between (``close_some``)."""

@dataclass
class ClientState:
    client_id: str
    streams: set = field(default_factory=set)
    last_seen_s: float = 0.0
    secret: str = ""  # sent in the welcome; a re-handshake on this routing id must present it (auth.py)
    owner: str | None = None  # CURVE: the client's public key (ZAP user id); every message must carry it


class Sessions:
    def __init__(self, cfg: ServerConfig, model: LoadedModel, arena: StateArena, scheduler: Scheduler,
                 metrics: Metrics, ipc_device: CudaIpcDevice | None = None, host_id: str | None = None,
                 ipc_off_reason: str = "not configured", clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.model = model
        self.arena = arena
        self.scheduler = scheduler
        self.metrics = metrics
        self._arena_used = metrics.arena_slots.labels(model=model.name, kind="used")  # slots in use
        self.clock = clock
        self.boot_epoch = uuid.uuid4().hex
        self.server_id = f"code2wav-sidecar-{self.boot_epoch[:8]}"
        self.limits = proto.Limits(
            max_message_bytes=cfg.limits.max_message_bytes, max_chunk_frames=cfg.limits.max_chunk_frames,
            max_chunks_per_message=cfg.limits.max_chunks_per_message,
            max_left_context_frames=cfg.limits.max_left_context_frames)
        self.model_info = model_entry(model)  # the welcome's entry: the model's contract, the same for every client
        self.clients: dict[bytes, ClientState] = {}
        self.streams: dict[tuple[bytes, str], ServedStream] = {}
        self.out = Outbox(metrics)  # what this turn leaves to send (replies.py)
        self.draining = False
        self.connlog = ConnLog(log)  # connect/disconnect lines, rate-limited
        self.pending_by_client: dict[bytes, int] = {}  # chunks queued or in the engine, per connection
        self.owners = SessionOwners(metrics)
        self.close_backlog: collections.deque[tuple[ServedStream, str]] = collections.deque()  # detached, to free
        self.regions = RegionService(ipc_device, host_id, metrics, self.out.send, self.out.error, ipc_off_reason,
                                     session_of=self.clients.get)

    def _pending_added(self, stream: ServedStream) -> None:
        stream.num_pending += 1
        self.pending_by_client[stream.client] = self.pending_by_client.get(stream.client, 0) + 1

    def _job_done(self, job: ChunkJob) -> None:
        """A queued chunk got its outcome: release the regions it used and its pending count."""
        for region in job.regions:
            self.regions.release(region)
        job.ipc_codes = job.audio_out = None
        self._pending_done(job.stream)

    def _pending_done(self, stream: ServedStream) -> None:
        stream.num_pending -= 1
        left = self.pending_by_client.get(stream.client, 1) - 1
        if left > 0:
            self.pending_by_client[stream.client] = left
        else:
            self.pending_by_client.pop(stream.client, None)

    # ------------------------------------------------------------------ input
    def on_message(self, identity: bytes, frames: list, user_id: str | None = None) -> None:
        try:
            msg = proto.decode_client_message(frames, self.limits)
        except ProtocolError as exc:
            self.out.error(identity, exc.request_id, exc.code, exc.message)
            return
        client = self.clients.get(identity)
        if client is not None and not isinstance(msg, proto.Hello) and not self.owners.owns(client.owner, user_id):
            self.owners.refused(identity, client.client_id, "a message from a CURVE key that does not own the session")
            return self.out.error(identity, msg.request_id, ErrorCode.INVALID_ARGUMENT, "this routing id has a "
                              "session owned by another CURVE client key; connect with a fresh routing id")
        if client is not None:
            client.last_seen_s = self.clock()
        if isinstance(msg, proto.Hello):
            self._hello(identity, msg, user_id)
        elif client is None:
            self.out.error(identity, msg.request_id, ErrorCode.INVALID_ARGUMENT,
                        f"{msg.TYPE} before the handshake: send hello first")
        elif isinstance(msg, proto.Ping):
            self.out.send(identity, proto.Pong(request_id=msg.request_id, boot_epoch=self.boot_epoch))
        elif isinstance(msg, proto.OpenStream):
            self._open(identity, client, msg)
        elif isinstance(msg, proto.Decode):
            self._decode(identity, msg, frames)
        elif isinstance(msg, proto.Finish):
            self._finish(identity, msg)
        elif isinstance(msg, proto.Abort):
            self._abort(identity, msg)
        elif isinstance(msg, proto.Bye):
            self.drop_client(identity, reason="bye")
        elif isinstance(msg, proto.RegisterRegion):
            self.regions.on_register(identity, msg)
        elif isinstance(msg, proto.UnregisterRegion):
            self.regions.on_unregister(identity, msg)

    def _hello(self, identity: bytes, msg: proto.Hello, user_id: str | None = None) -> None:
        old = self.clients.get(identity)
        if old is not None:
            why = self.owners.rehandshake_refusal(old.owner, old.secret, user_id, msg.session_secret)
            if why is not None:  # the session stays as it is
                self.owners.refused(identity, msg.client_id, why)
                return self.out.error(identity, msg.request_id, ErrorCode.INVALID_ARGUMENT, why)
            self.drop_client(identity, reason="rehandshake")
        secret = new_session_secret()
        self.clients[identity] = ClientState(client_id=msg.client_id, last_seen_s=self.clock(), secret=secret,
                                             owner=user_id)
        self.metrics.clients.set(len(self.clients))
        self.connlog.connected(msg.client_id, len(self.clients))
        self.out.send(identity, proto.Welcome(
            request_id=msg.request_id, version=proto.PROTOCOL_VERSION, server_id=self.server_id,
            boot_epoch=self.boot_epoch, models=(self.model_info,), default_model=self.model.name, limits=self.limits,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s, capabilities=self.regions.capabilities(),
            session_secret=secret))

    def _open(self, identity: bytes, client: ClientState, msg: proto.OpenStream) -> None:
        rid = msg.request_id
        if self.draining:
            return self.out.error(identity, rid, ErrorCode.UNAVAILABLE, "the sidecar is shutting down")
        if msg.model not in (None, self.model.name):
            return self.out.error(identity, rid, ErrorCode.NOT_FOUND,
                               f"model '{msg.model}' is not served here; available: {self.model.name}")
        mode = get_mode(msg.mode)
        try:
            options = self.model.contract.check_options(msg.options)
        except FamilyError as exc:
            return self.out.error(identity, rid, ErrorCode.INVALID_ARGUMENT, str(exc))
        left = mode.left_context_frames(msg.left_context_frames)
        existing = self.streams.get((identity, msg.stream_id))
        if existing is not None:
            if not is_repeat_open(existing, self.model.name, mode, left, options):
                return self.out.error(identity, rid, ErrorCode.ALREADY_EXISTS, f"stream '{msg.stream_id}' is already "
                                  "open (with other parameters, or it has taken chunks)")
            existing.last_active_s = self.clock()  # just said open: not reaped as idle right after
            return self._send_opened(identity, rid, existing)
        if len(client.streams) >= self.cfg.limits.max_streams_per_client:
            return self.out.error(identity, rid, ErrorCode.BUSY,
                               f"this client has {len(client.streams)} open streams (limit max_streams_per_client)")
        slot = None
        if mode.stateful:
            try:
                slot = self.arena.allocate()
            except ArenaFull as exc:
                return self.out.error(identity, rid, ErrorCode.BUSY, f"{exc}; retry later or raise streams.max_streams")
            self._arena_used.set(self.arena.num_used)
        stream = ServedStream(client=identity, stream_id=msg.stream_id, model=self.model.name, mode=mode,
                        left_context_frames=left, slot=slot, last_active_s=self.clock(), options=options)
        self.streams[stream.key] = stream
        client.streams.add(msg.stream_id)
        self.metrics.streams_opened.labels(mode=msg.mode).inc()
        self.metrics.active_streams.set(len(self.streams))
        self._send_opened(identity, rid, stream)

    def _send_opened(self, identity: bytes, rid: int, stream: ServedStream) -> None:
        self.out.send(identity, proto.Opened(
            request_id=rid, stream_id=stream.stream_id, model=stream.model, mode=stream.mode.name,
            left_context_frames=stream.left_context_frames, samples_per_frame=self.model.samples_per_frame,
            num_quantizers=self.model.num_quantizers))

    def _decode(self, identity: bytes, msg: proto.Decode, frames: list) -> None:
        now = self.clock()
        reply = PendingReply(identity, msg.request_id, len(msg.chunks))
        for index, chunk in enumerate(msg.chunks):
            stream = self.streams.get((identity, chunk.stream_id))
            try:
                if self.draining:
                    raise ChunkRejected(ErrorCode.UNAVAILABLE, "the sidecar is shutting down")
                if stream is None or stream.closed:
                    raise ChunkRejected(ErrorCode.NOT_FOUND, f"stream '{chunk.stream_id}' is not open")
                if stream.closing is not None:
                    raise ChunkRejected(ErrorCode.INVALID_ARGUMENT,
                                        f"stream '{chunk.stream_id}' is closing ({stream.closing})")
                verdict, reason = check_seq(stream, chunk.seq)
                if verdict == SeqVerdict.RESEND:
                    reply.resolve(index, stream.stream_id, chunk.seq, stream.last_audio, stream.last_num_frames)
                    continue
                if verdict != SeqVerdict.ACCEPT:
                    raise ChunkRejected(ErrorCode.OUT_OF_ORDER, reason)
                job = ChunkJob(stream=stream, seq=chunk.seq, codes=None, context_frames=chunk.context_frames,
                               final=chunk.final, arrived_s=now, reply=reply, index=index)
                read_chunk_inputs(self.model, self.regions, identity, job, chunk, frames)
                if chunk.num_frames == 0:  # an empty final chunk: nothing to decode, an empty inline reply
                    stream.next_seq += 1
                    self._pending_added(stream)
                    self.complete_job(job, torch.zeros(0, dtype=torch.float32))
                    continue
                if self.pending_by_client.get(identity, 0) >= self.cfg.limits.max_pending_chunks_per_client:
                    raise ChunkRejected(ErrorCode.BUSY, f"this client has {self.pending_by_client[identity]} chunks "
                                        "queued (limits.max_pending_chunks_per_client); retry with backoff")
                if not self.scheduler.submit(job):
                    raise ChunkRejected(ErrorCode.BUSY, f"{len(self.scheduler)} chunks are queued "
                                        "(scheduler.max_pending_chunks); retry with backoff")
                for region in job.regions:
                    self.regions.acquire(region)
                stream.next_seq += 1
                self._pending_added(stream)
                stream.last_active_s = now
                if chunk.final:
                    stream.closing = "final"
            except ChunkRejected as exc:
                self.out.reject(reply, index, chunk.stream_id, chunk.seq, exc.code, exc.message)
        self.metrics.queue_depth.set(len(self.scheduler))
        self.out.emit_if_done(reply)

    def _finish(self, identity: bytes, msg: proto.Finish) -> None:
        stream = self.streams.get((identity, msg.stream_id))
        if stream is None:
            return self.out.error(identity, msg.request_id, ErrorCode.NOT_FOUND,
                                  f"stream '{msg.stream_id}' is not open")
        if stream.num_pending == 0:
            self._close(stream, "finish")
            self.out.send(identity, proto.Finished(request_id=msg.request_id, stream_id=msg.stream_id))
        else:
            stream.closing = stream.closing or "finish"
            stream.finish_waiters.append(msg.request_id)

    def _abort(self, identity: bytes, msg: proto.Abort) -> None:
        stream = self.streams.get((identity, msg.stream_id))
        if stream is None:
            return self.out.error(identity, msg.request_id, ErrorCode.NOT_FOUND,
                                  f"stream '{msg.stream_id}' is not open")
        self.abort_stream(stream, "abort")
        self.out.send(identity, proto.Aborted(request_id=msg.request_id, stream_id=msg.stream_id))

    # ------------------------------------------------------------------ engine side
    def build_items(self, batch: list[ChunkJob]) -> list[DecodeItem]:
        """Engine thread (reads stream state that no other thread writes while the chunk is in the engine)."""
        return [job.stream.mode.build_item(job) for job in batch]

    def complete_job(self, job: ChunkJob, audio: Tensor) -> None:
        stream = job.stream
        ipc = None if job.audio_out is None else (job.audio_out[2], job.audio_event)
        self._job_done(job)
        num_frames = audio.numel() // self.model.samples_per_frame  # frames that produced audio
        if not stream.closed:
            stream.committed_seq = job.seq
            stream.last_audio = audio
            stream.last_num_frames = num_frames
            stream.last_active_s = self.clock()
            stream.mode.commit(stream, job.codes)
            series = self.metrics.mode_series(stream.model, stream.mode.name)
            series.chunks.inc()
            series.frames.inc(job.codes.shape[1])
            series.audio_seconds.inc(audio.numel() / self.model.sample_rate_hz)
            series.chunk_latency.observe(self.clock() - job.arrived_s)
        job.reply.resolve(job.index, stream.stream_id, job.seq, audio, num_frames, ipc)
        self.out.emit_if_done(job.reply)
        if job.final or (stream.closing and stream.num_pending == 0):
            self._close(stream, stream.closing or "final")

    def fail_job(self, job: ChunkJob, code: ErrorCode, message: str) -> None:
        """The chunk produced no audio: its stream keeps the state it had, later queued chunks fail too."""
        stream = job.stream
        self._job_done(job)
        if not stream.closed:
            stream.next_seq = job.seq
            if stream.closing == "final":
                stream.closing = None
            for later in self.scheduler.remove_stream(stream):
                self._job_done(later)
                self.out.reject(later.reply, later.index, stream.stream_id, later.seq, ErrorCode.OUT_OF_ORDER,
                             f"an earlier chunk (seq {job.seq}) failed; resend from seq {job.seq}")
                self.out.emit_if_done(later.reply)
        self.out.reject(job.reply, job.index, stream.stream_id, job.seq, code, message)
        self.out.emit_if_done(job.reply)
        if stream.closing and stream.num_pending == 0 and not stream.closed:
            self._close(stream, stream.closing)

    # ------------------------------------------------------------------ lifecycle
    def abort_stream(self, stream: ServedStream, reason: str) -> None:
        for job in self.scheduler.remove_stream(stream) if stream.num_pending else ():  # (no queue scan if idle)
            self._job_done(job)
            self.out.reject(job.reply, job.index, stream.stream_id, job.seq, ErrorCode.UNAVAILABLE,
                         f"stream '{stream.stream_id}' was aborted ({reason})")
            self.out.emit_if_done(job.reply)
        self._close(stream, reason)

    def _close(self, stream: ServedStream, reason: str) -> None:
        if stream.closed:
            return
        stream.closed = True
        self._detach(stream)  # (a stream from close_backlog was detached already)
        if stream.slot is not None and stream.num_pending == 0:
            self.arena.release(stream.slot)
            stream.slot = None
        for rid in stream.finish_waiters:
            self.out.send(stream.client, proto.Finished(request_id=rid, stream_id=stream.stream_id))
        stream.finish_waiters.clear()
        self.metrics.streams_closed.labels(reason=reason).inc()
        self.metrics.active_streams.set(len(self.streams))
        self._arena_used.set(self.arena.num_used)

    def _detach(self, stream: ServedStream) -> None:
        """Take ``stream`` out of the session's maps (no-op if it is not there any more)."""
        if self.streams.get(stream.key) is stream:
            del self.streams[stream.key]
            client = self.clients.get(stream.client)
            if client is not None:
                client.streams.discard(stream.stream_id)

    def release_in_flight(self, batch: list[ChunkJob]) -> None:
        """After an engine step: free slots of streams closed while their chunk was in the engine."""
        for job in batch:
            stream = job.stream
            if stream.closed and stream.slot is not None and stream.num_pending == 0:
                self.arena.release(stream.slot)
                stream.slot = None
        self._arena_used.set(self.arena.num_used)

    def drop_client(self, identity: bytes, reason: str) -> None:
        client = self.clients.pop(identity, None)
        if client is None:
            return
        self.connlog.disconnected(client.client_id, reason, len(client.streams), len(self.clients))
        num_streams = len(client.streams)
        for stream_id in client.streams:
            stream = self.streams.pop((identity, stream_id), None)
            if stream is not None:
                self.close_backlog.append((stream, reason))
        client.streams.clear()
        if num_streams > CLOSE_SLICE_STREAMS:
            log.info("client '%s' left (%s) with %d open streams: freeing them in slices of %d", client.client_id,
                     reason, num_streams, CLOSE_SLICE_STREAMS)
        self.close_some(CLOSE_SLICE_STREAMS)
        self.regions.drop_client(identity)
        self.metrics.clients.set(len(self.clients))

    def reap(self, now_s: float) -> int:
        """Free what ``reaping.plan_reap`` names (streams idle past the TTL; clients silent past
        ``client_silence_s``, with their streams), in slices. Returns the streams reaped for idleness."""
        ttl, silence_s = self.cfg.streams.ttl_s, self.cfg.streams.client_silence_s
        plan = plan_reap(self.streams, self.clients, now_s, ttl, silence_s, busy=self.pending_by_client)
        for stream in plan.idle_streams:  # detached now (O(1) each), freed in slices by close_some
            self._detach(stream)
            self.close_backlog.append((stream, "ttl"))
        num_client_streams = sum(len(self.clients[identity].streams) for identity in plan.gone_clients)
        for identity in plan.gone_clients:
            self.drop_client(identity, reason="silent")
        if plan:  # one summary line, not one per stream
            oldest_s = max((now_s - s.last_active_s for s in plan.idle_streams), default=0.0)
            log.info("reaping %d streams idle past the TTL (%.0fs; longest idle %.1fs); forgetting %d clients silent "
                     "for over %.0fs, with their %d other streams", len(plan.idle_streams), ttl, oldest_s,
                     len(plan.gone_clients), min(silence_s, ttl), num_client_streams)
        self.close_some(CLOSE_SLICE_STREAMS)
        return len(plan.idle_streams)

    def close_some(self, max_streams: int) -> bool:
        """Free up to ``max_streams`` detached streams of ``close_backlog``; True while more are waiting
        (the server calls again on its next loop turn)."""
        for _ in range(min(max_streams, len(self.close_backlog))):
            stream, reason = self.close_backlog.popleft()
            self.abort_stream(stream, reason)
        return bool(self.close_backlog)
