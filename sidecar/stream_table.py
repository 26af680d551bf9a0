"""The open streams (sans-IO): open, finish, abort, close and reap them; their arena slots and queued chunks.

Rules (``streams.py`` states the per-stream ones): a stream belongs to the connection that opened it; a stateful
stream holds an arena slot until it is closed and no chunk of it is in the engine; ``finish`` closes a stream
once its queued chunks are done, ``abort`` drops them now; a departed client's streams are detached at once and
freed in slices (``close_some``), so one client leaving with thousands of streams does not hold the loop.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

from code2wav import proto
from code2wav.proto import ErrorCode

from .jobs import ChunkJob
from .metrics import Metrics
from .models import FamilyError, LoadedModel
from .modes import get_mode
from .replies import Outbox
from .scheduler import Scheduler
from .state_store import ArenaFull, StateArena
from .streams import LateFailure, ServedStream, is_repeat_open

log = logging.getLogger(__name__)

CLOSE_SLICE_STREAMS = 512
"""Streams freed per loop turn when a client with many streams leaves (bye, re-handshake, TTL): the rest wait in
``close_backlog`` so pings of other clients are answered in between (``close_some``)."""


class StreamTable:
    def __init__(self, model: LoadedModel, arena: StateArena, scheduler: Scheduler, out: Outbox, metrics: Metrics,
                 release_region: Callable, clock: Callable[[], float]) -> None:
        self.model = model
        self.arena = arena
        self.scheduler = scheduler
        self.out = out
        self.metrics = metrics
        self.release_region = release_region  # a queued chunk's use of a CUDA IPC region ends
        self.clock = clock
        self.streams: dict[tuple[bytes, str], ServedStream] = {}
        self.ids_by_client: dict[bytes, set[str]] = {}  # the open streams' ids, per connection
        self.pending_by_client: dict[bytes, int] = {}  # chunks queued or in the engine, per connection
        self.close_backlog: collections.deque[tuple[ServedStream, str]] = collections.deque()  # detached, to free
        self._arena_used = metrics.arena_slots.labels(model=model.name, kind="used")

    def __len__(self) -> int:
        return len(self.streams)

    def get(self, identity: bytes, stream_id: str) -> ServedStream | None:
        return self.streams.get((identity, stream_id))

    # ------------------------------------------------------------------ open, finish, abort
    def open(self, identity: bytes, msg: proto.OpenStream, max_per_client: int) -> None:
        """``open_stream``: a new stream (a slot for a stateful mode), or ``opened`` again for a repeated open."""
        rid = msg.request_id
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
            if not is_repeat_open(existing, self.model.name, mode, left, options, msg.early_audio):
                return self.out.error(identity, rid, ErrorCode.ALREADY_EXISTS, f"stream '{msg.stream_id}' is "
                                      "already open (with other parameters, or it has taken chunks)")
            existing.last_active_s = self.clock()  # just said open: not reaped as idle right after
            return self._send_opened(rid, existing)
        client_streams = self.ids_by_client.setdefault(identity, set())
        if len(client_streams) >= max_per_client:
            return self.out.error(identity, rid, ErrorCode.BUSY, f"this client has {len(client_streams)} open "
                                  "streams (limit max_streams_per_client)")
        slot = None
        if mode.stateful:
            try:
                # a failover replay resumes at its original positions (proto/README.md, section 11)
                slot = self.arena.allocate(msg.start_frame)
            except ArenaFull as exc:
                return self.out.error(identity, rid, ErrorCode.BUSY,
                                      f"{exc}; retry later or raise streams.max_streams")
            self._arena_used.set(self.arena.num_used)
        stream = ServedStream(client=identity, stream_id=msg.stream_id, model=self.model.name, mode=mode,
                              left_context_frames=left, slot=slot, last_active_s=self.clock(), options=options,
                              early_audio=msg.early_audio)
        self.streams[stream.key] = stream
        client_streams.add(msg.stream_id)
        self.metrics.streams_opened.labels(mode=mode.name).inc()
        self.metrics.active_streams.set(len(self.streams))
        self._send_opened(rid, stream)

    def _send_opened(self, request_id: int, stream: ServedStream) -> None:
        self.out.send(stream.client, proto.Opened(
            request_id=request_id, stream_id=stream.stream_id, model=stream.model, mode=stream.mode.name,
            left_context_frames=stream.left_context_frames, samples_per_frame=self.model.samples_per_frame,
            num_quantizers=self.model.num_channels))

    def finish(self, identity: bytes, msg: proto.Finish) -> None:
        stream = self.streams.get((identity, msg.stream_id))
        if stream is None:
            return self.out.error(identity, msg.request_id, ErrorCode.NOT_FOUND,
                                  f"stream '{msg.stream_id}' is not open")
        if stream.late_failure is not None and stream.num_pending == 0:  # it stays open: the chunk comes again
            stream.finish_waiters.append(msg.request_id)
            return self.refuse_finish(stream)
        if stream.num_pending == 0:
            self.close(stream, "finish")
            self.out.send(identity, proto.Finished(request_id=msg.request_id, stream_id=msg.stream_id))
        else:
            stream.closing = stream.closing or "finish"
            stream.finish_waiters.append(msg.request_id)

    def abort(self, identity: bytes, msg: proto.Abort) -> None:
        stream = self.streams.get((identity, msg.stream_id))
        if stream is None:
            return self.out.error(identity, msg.request_id, ErrorCode.NOT_FOUND,
                                  f"stream '{msg.stream_id}' is not open")
        self.abort_stream(stream, "abort")
        self.out.send(identity, proto.Aborted(request_id=msg.request_id, stream_id=msg.stream_id))

    # ------------------------------------------------------------------ queued chunks
    def chunk_queued(self, stream: ServedStream) -> None:
        stream.num_pending += 1
        self.pending_by_client[stream.client] = self.pending_by_client.get(stream.client, 0) + 1

    def chunk_done(self, job: ChunkJob) -> None:
        """A queued chunk got its outcome: release the regions it used and its pending count."""
        for region in job.regions:
            self.release_region(region)
        job.ipc_codes = job.audio_out = None
        stream = job.stream
        stream.num_pending -= 1
        left = self.pending_by_client.get(stream.client, 1) - 1
        if left > 0:
            self.pending_by_client[stream.client] = left
        else:
            self.pending_by_client.pop(stream.client, None)

    def release_in_flight(self, batch: list[ChunkJob]) -> None:
        """After an engine step: free slots of streams closed while their chunk was in the engine."""
        for job in batch:
            stream = job.stream
            if stream.closed and stream.slot is not None and stream.num_pending == 0:
                self.arena.release(stream.slot)
                stream.slot = None
        self._arena_used.set(self.arena.num_used)

    # ------------------------------------------------------------------ closing
    def abort_stream(self, stream: ServedStream, reason: str) -> None:
        for job in self.scheduler.remove_stream(stream) if stream.num_pending else ():  # (no queue scan if idle)
            self.chunk_done(job)
            self.out.reject(job.reply, job.index, stream.stream_id, job.seq, ErrorCode.UNAVAILABLE,
                            f"stream '{stream.stream_id}' was aborted ({reason})")
            self.out.emit_if_done(job.reply)
        self.close(stream, reason)

    def refuse_finish(self, stream: ServedStream) -> None:
        """The stream's finish waiters are answered with its late failure (an early-answered chunk refused after
        its reply): the stream stays open, as after a failed final chunk."""
        failure = stream.late_failure
        for rid in stream.finish_waiters:
            self.out.error(stream.client, rid, failure.code, late_failure_message(stream, failure), failure.seq)
        stream.finish_waiters.clear()
        stream.closing = None

    def close(self, stream: ServedStream, reason: str) -> None:
        if stream.closed:
            return
        stream.closed = True
        self.detach(stream)  # (a stream from close_backlog was detached already)
        if stream.slot is not None and stream.num_pending == 0:
            self.arena.release(stream.slot)
            stream.slot = None
        for rid in stream.finish_waiters:
            self.out.send(stream.client, proto.Finished(request_id=rid, stream_id=stream.stream_id))
        stream.finish_waiters.clear()
        self.metrics.streams_closed.labels(reason=reason).inc()
        self.metrics.active_streams.set(len(self.streams))
        self._arena_used.set(self.arena.num_used)

    def detach(self, stream: ServedStream) -> None:
        """Take ``stream`` out of the table and its client's set (no-op if it is not there any more)."""
        if self.streams.get(stream.key) is stream:
            del self.streams[stream.key]
            self.ids_by_client.get(stream.client, set()).discard(stream.stream_id)

    def num_open(self, identity: bytes) -> int:
        return len(self.ids_by_client.get(identity, ()))

    def detach_all(self, identity: bytes, reason: str) -> int:
        """A client left: its streams leave the table now and are freed in slices (``close_some``). Returns how
        many."""
        stream_ids = self.ids_by_client.pop(identity, set())
        for stream_id in stream_ids:
            stream = self.streams.pop((identity, stream_id), None)
            if stream is not None:
                self.close_backlog.append((stream, reason))
        return len(stream_ids)

    def close_some(self, max_streams: int = CLOSE_SLICE_STREAMS) -> bool:
        """Free up to ``max_streams`` detached streams of ``close_backlog``; True while more are waiting (the server
        calls again on its next loop turn)."""
        for _ in range(min(max_streams, len(self.close_backlog))):
            stream, reason = self.close_backlog.popleft()
            self.abort_stream(stream, reason)
        return bool(self.close_backlog)

    def reap_idle(self, plan_streams: list[ServedStream]) -> None:
        """Streams idle past the TTL (``reaping.plan_reap``): detached now (O(1) each), freed in slices."""
        for stream in plan_streams:
            self.detach(stream)
            self.close_backlog.append((stream, "ttl"))


def late_failure_message(stream: ServedStream, failure: LateFailure) -> str:
    """What a finish (or a later chunk's error) says of a chunk refused after its early reply."""
    return (f"chunk seq {failure.seq} of stream '{stream.stream_id}' was refused after its early audio reply "
            f"({failure.message}); do not use that chunk's audio (a chunk refused by its step reads as zeros); the "
            f"stream continues from seq {failure.seq}: send seq {failure.seq} again")
