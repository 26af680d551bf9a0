"""Scheduler: which queued chunks share the next engine forward (policy only; no model, no sockets).

- One FIFO over all streams of all clients: the oldest chunk is always in the next batch, so nothing starves.
- A batch holds chunks of one ``(model, mode)`` key (exact and window never mix), at most one chunk per
  stream (a stream's next chunk needs the state its previous chunk commits), at most ``max_batch_size``.
- A bounded queue: past ``max_pending_chunks`` a chunk is refused at once (the caller answers busy).
- Batching window: a batch that is not full waits until its oldest chunk is ``batch_window_s`` old, so a
  lone chunk is delayed by at most that; except when no company can come: every open stream (the caller's count)
  already has a chunk queued (one stream alone, or a closed loop whose every stream waits), so the wait would be
  pure latency. The queued streams counted may include some being closed (a departed client's, detached and
  freed in slices a loop turn later): then a batch runs before its window ends, never after it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from .streams import ServedStream


@dataclass(eq=False)
class ChunkJob:
    stream: ServedStream
    seq: int
    codes: Any  # torch.Tensor [C, n]: int64 codes or float32 latents
    context_frames: int
    final: bool
    arrived_s: float
    reply: Any  # the PendingReply this chunk's result belongs to
    index: int  # position of this chunk's result in the reply
    ipc_codes: tuple | None = None  # (Region, view [Q, n], codes_event): codes still in the client's region
    audio_out: tuple | None = None  # (Region, view [num_samples], TensorDesc): write the audio there
    audio_event: int | None = None  # set by the engine step: the region event recorded after writing

    @property
    def regions(self) -> list:
        """The CUDA IPC regions this chunk reads or writes (each holds one use per chunk)."""
        return [use[0] for use in (self.ipc_codes, self.audio_out) if use is not None]

    @property
    def kept_context(self):
        """The inputs ``[C, c]`` the stream's mode decodes ahead of this chunk's own (window: the kept left
        context), or None."""
        return self.stream.mode.kept_context(self.stream)

    @property
    def decoded_frames(self) -> int:
        """Frames the engine decodes for this chunk (its codes may still be in a CUDA IPC region): its own, after
        the ``kept_context`` (the mode's ``build_item`` joins them)."""
        own = (self.codes if self.ipc_codes is None else self.ipc_codes[1]).shape[1]
        prefix = self.kept_context
        return own + (0 if prefix is None else prefix.shape[1])

    @property
    def batch_key(self) -> tuple[str, str]:
        return (self.stream.model, self.stream.mode.name)


class Scheduler:
    def __init__(self, max_batch_size: int, batch_window_s: float, max_pending_chunks: int) -> None:
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.max_pending_chunks = max_pending_chunks
        self._queue: deque[ChunkJob] = deque()
        self._queued_per_stream: Counter[int] = Counter()  # id(stream) -> its chunks in the queue

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, job: ChunkJob) -> bool:
        """Queue ``job``; False when the queue is full (answer busy)."""
        if len(self._queue) >= self.max_pending_chunks:
            return False
        self._queue.append(job)
        self._queued_per_stream[id(job.stream)] += 1
        return True

    def seconds_until_ready(self, now_s: float, num_open_streams: int | None = None) -> float | None:
        """None when nothing is queued; 0 when a batch should run now; else how long to wait for company.
        ``num_open_streams``: streams that may send chunks (None: unknown); when every one of them has a chunk
        queued already, no other stream can join the batch and it runs now."""
        if not self._queue:
            return None
        if len(self._queue) >= self.max_batch_size:
            return 0.0
        if num_open_streams is not None and len(self._queued_per_stream) >= num_open_streams:
            return 0.0
        return max(0.0, self._queue[0].arrived_s + self.batch_window_s - now_s)

    def _forget(self, jobs) -> None:
        """Count ``jobs`` (just taken out of the queue) out of the per-stream counts."""
        counts = self._queued_per_stream
        for job in jobs:
            key = id(job.stream)
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]

    def take_batch(self) -> list[ChunkJob]:
        """Remove and return the next batch (FIFO, one key, one chunk per stream)."""
        if not self._queue:
            return []
        key = self._queue[0].batch_key
        batch: list[ChunkJob] = []
        seen: set[int] = set()
        kept: deque[ChunkJob] = deque()
        while self._queue:
            job = self._queue.popleft()
            if len(batch) < self.max_batch_size and job.batch_key == key and id(job.stream) not in seen:
                batch.append(job)
                seen.add(id(job.stream))
            else:
                kept.append(job)
                if len(batch) >= self.max_batch_size:
                    break
        kept.extend(self._queue)
        self._queue = kept
        self._forget(batch)
        return batch

    def requeue(self, jobs: list[ChunkJob]) -> None:
        """Put jobs taken by ``take_batch`` back at the front, in their order (their inputs were not ready)."""
        self._queue.extendleft(reversed(jobs))
        for job in jobs:
            self._queued_per_stream[id(job.stream)] += 1

    def remove_stream(self, stream: ServedStream) -> list[ChunkJob]:
        """Drop and return every queued chunk of ``stream`` (abort, or an earlier chunk failed)."""
        dropped = [j for j in self._queue if j.stream is stream]
        if dropped:
            self._queue = deque(j for j in self._queue if j.stream is not stream)
            self._forget(dropped)
        return dropped
