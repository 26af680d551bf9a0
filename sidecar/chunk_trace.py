"""Where one chunk's time goes inside the sidecar: the stage stamps of the last N chunks (``trace_chunks``), for
``code2wav-sidecar bench --stages`` (loadgen/stages.py), served as JSON at ``/debug/chunk-stages``.

Off by default (``trace_chunks: 0``): then nothing here exists, and each place that stamps costs one ``is None``
check. On, a chunk accepted into the scheduler gets a ``ChunkStamps`` (on its ``ChunkJob`` and on the reply it
belongs to), and each part of its way stamps it with ``time.monotonic_ns()``:

- ``received_ns``: the socket loop took the message off the socket (``loop_io.SocketLoop.on_readable``);
- ``queued_ns``: the chunk, parsed and checked, is in the scheduler's queue (``chunk_flow.ChunkFlow``);
- ``taken_ns``: the stepper took it into a batch (a chunk put back and taken again: the last take);
- ``launched_ns``: its step was launched on the engine (items built, inputs copied in, the graph replayed or the
  eager forward issued; on the CPU the forward has run by then);
- ``done_ns``: the step's audio is on the host (a CUDA IPC chunk: its audio copy into the client's region queued,
  the reply ready to leave);
- ``sent_ns``: its reply, encoded, is handed to the socket (``loop_io.SocketLoop.flush``: stamped right before
  libzmq takes it, so the client's receive stamp always comes later).

CLOCK_MONOTONIC is one clock for every process of a Linux host, so these stamps and a client's on the same host
(``client.call_trace``) subtract directly. A chunk is recorded once its reply is sent, if its step produced
audio; the ring keeps the last ``capacity`` of them.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any, Callable

CHUNK_STAGES_PATH = "/debug/chunk-stages"
"""Where the metrics endpoint serves the records (with ``trace_chunks`` on; 404 otherwise)."""
STAGE_STAMPS = ("received_ns", "queued_ns", "taken_ns", "launched_ns", "done_ns", "sent_ns")
"""The sidecar's stamps of a chunk, in the order a chunk passes them."""


class ChunkStamps:
    """One chunk's stamps (0: not reached yet)."""

    __slots__ = ("stream_id", "seq", *STAGE_STAMPS)

    def __init__(self, stream_id: str, seq: int, received_ns: int, queued_ns: int) -> None:
        self.stream_id = stream_id
        self.seq = seq
        self.received_ns = received_ns
        self.queued_ns = queued_ns
        self.taken_ns = self.launched_ns = self.done_ns = self.sent_ns = 0

    def as_dict(self) -> dict[str, Any]:
        return {"stream_id": self.stream_id, "seq": self.seq, **{name: getattr(self, name) for name in STAGE_STAMPS}}


class ChunkTrace:
    """The recorder: stamps chunks on their way and keeps the last ``capacity`` complete ones. Used from the loop
    thread and the engine thread (each chunk is stamped by one of them at a time: its stamps need no lock; the ring
    is appended to on the loop thread only)."""

    def __init__(self, capacity: int, clock: Callable[[], int] = time.monotonic_ns) -> None:
        if capacity < 1:
            raise ValueError(f"a chunk trace keeps at least 1 chunk, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        self.received_ns = 0  # when the message being handled now was taken off the socket
        self.num_recorded = 0  # chunks recorded since the start (the ring holds the last ``capacity``)
        self._ring: collections.deque[ChunkStamps] = collections.deque(maxlen=capacity)

    def message_received(self) -> None:
        """The socket loop took a message off the socket (its chunks, if queued, were received now)."""
        self.received_ns = self.clock()

    def queued(self, job, reply) -> None:
        """``job`` (of ``reply``) is in the scheduler's queue now: it gets its stamps."""
        stamps = ChunkStamps(job.stream.stream_id, job.seq, self.received_ns, self.clock())
        job.stamps = stamps
        if reply.stamps is None:
            reply.stamps = []
        reply.stamps.append(stamps)

    def stamp(self, jobs: list, stage: str) -> None:
        """``jobs`` reached ``stage`` (``taken_ns``, ``launched_ns`` or ``done_ns``) now."""
        now = self.clock()
        for job in jobs:
            if job.stamps is not None:
                setattr(job.stamps, stage, now)

    def sent(self, stamps: list[ChunkStamps]) -> None:
        """The reply holding ``stamps`` was handed to the socket: the chunks whose step produced audio are
        recorded."""
        now = self.clock()
        for chunk in stamps:
            chunk.sent_ns = now
            if chunk.done_ns:
                self._ring.append(chunk)
                self.num_recorded += 1

    def records(self) -> list[dict[str, Any]]:
        """The recorded chunks, oldest first."""
        return [chunk.as_dict() for chunk in self._ring]

    def json_body(self) -> tuple[int, bytes]:
        """What ``/debug/chunk-stages`` serves: ``(HTTP status, JSON body)``."""
        body = {"clock": "CLOCK_MONOTONIC ns", "capacity": self.capacity, "recorded": self.num_recorded,
                "stamps": list(STAGE_STAMPS), "chunks": self.records()}
        return 200, json.dumps(body).encode()
