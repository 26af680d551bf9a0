"""Scheduler: which queued chunks share the next engine forward (policy only; no model, no sockets).

- One FIFO over all streams of all clients: the oldest chunk is in the next batch (or, when it is long and the
  last batch was long too, the one after: below), so nothing starves.
- A batch holds chunks of one ``(model, mode)`` key (exact and window never mix), at most one chunk per
  stream (a stream's next chunk needs the state its previous chunk commits), at most ``max_batch_size``; and a
  stream's chunks run in arrival order: one left in the queue holds its stream's later chunks back too.
- Long chunks batch apart: a chunk that decodes more frames than the mode's longest captured graph runs eager (a
  failover's history replay, a client sending whole utterances); one such row in a batch would take every row of
  it out of its graph into a slower eager step, so long chunks batch only with long chunks (``graph_frames``).
- Long batches never run twice in a row while a short chunk waits: after a long batch the next one starts from the
  oldest short chunk, if any is queued. A mass failover queues hundreds of replays at once; without this rule a
  live chunk arriving behind them waits for every one of their eager steps, with it for one at most. The replays
  still run at least every other step (FIFO picks them again as the oldest), so neither kind starves.
- A bounded queue: past ``max_pending_chunks`` a chunk is refused at once (the caller answers busy).
- Batching window: a batch that is not full waits until its oldest chunk is ``batch_window_s`` old, so a
  lone chunk is delayed by at most that; except when no company can come: every open stream (the caller's count)
  already has a chunk queued (one stream alone, or a closed loop whose every stream waits), so the wait would be
  pure latency. The queued streams counted may include some being closed (a departed client's, detached and
  freed in slices a loop turn later): then a batch runs before its window ends, never after it.
- Draining (the server is stopping): queued chunks run now, without waiting for company.
- Steps in flight (the stepper launches the next step while the last one still runs on the device): the streams
  with a chunk in such a step are ``busy``; their queued chunks wait for it (their state is not committed yet) and
  count neither for a full batch nor for the window. Nobody else can join when every open stream is queued or busy.

The numbers are a ``BatchPolicy``, decided once at start-up by ``batch_policy`` (the configured values, the batch
size capped to what the captured graphs serve) and never changed afterwards.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from .jobs import ChunkJob
from .streams import ServedStream


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int  # chunks per step
    batch_window_s: float  # how long a lone chunk may wait for company
    max_pending_chunks: int  # queued chunks; past it a chunk is refused (busy)
    # (mode, the longest chunk its graphs serve), sorted; empty: long and short chunks batch together
    graph_frames: tuple[tuple[str, int], ...] = ()

    def is_long(self, mode: str, decoded_frames: int) -> bool:
        """A chunk past its mode's longest captured graph (it runs eager, so it batches with its kind only)."""
        return any(name == mode and decoded_frames > frames for name, frames in self.graph_frames)


def batch_policy(max_batch_size: int, batch_window_us: int, max_pending_chunks: int,
                 largest_graph_batch: int = 0, graph_frames: dict[str, int] | None = None) -> BatchPolicy:
    """The policy from the configured values. ``largest_graph_batch``: the most rows a captured stateful graph
    serves whatever the chunk length (0: no graphs); batches stop there, since a larger batch would run eager (and
    eager steps in a graph server measured many times slower than a replay). ``graph_frames``: per mode, the
    longest chunk a captured graph serves (long chunks batch apart)."""
    if largest_graph_batch:
        max_batch_size = min(max_batch_size, largest_graph_batch)
    return BatchPolicy(max_batch_size, batch_window_us / 1e6, max_pending_chunks,
                       tuple(sorted((graph_frames or {}).items())))


class Scheduler:
    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self.draining = False  # the server is stopping: queued chunks run now
        self._queue: deque[ChunkJob] = deque()
        self._queued_per_stream: Counter[int] = Counter()  # id(stream) -> its chunks in the queue
        self._last_long = False  # the last batch taken was long chunks (the next one prefers short ones)

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, job: ChunkJob) -> bool:
        """Queue ``job``; False when the queue is full (answer busy)."""
        if len(self._queue) >= self.policy.max_pending_chunks:
            return False
        self._queue.append(job)
        self._queued_per_stream[id(job.stream)] += 1
        return True

    def seconds_until_ready(self, now_s: float, num_open_streams: int | None = None,
                            busy: frozenset[int] | set[int] = frozenset()) -> float | None:
        """None when nothing is queued that may run (``busy``: ``id(stream)`` of streams in a step in flight);
        0 when a batch should run now; else how long to wait for company. ``num_open_streams``: streams that may
        send chunks (None: unknown); when every one of them has a chunk queued or is busy, no other stream can
        join the batch and it runs now."""
        oldest = self._oldest(busy)
        if oldest is None:
            return None
        counts = self._queued_per_stream
        launchable = len(self._queue) - sum(counts.get(key, 0) for key in busy) if busy else len(self._queue)
        if launchable >= self.policy.max_batch_size or self.draining:
            return 0.0
        if num_open_streams is not None:
            waiting = len(counts) - sum(1 for key in busy if key in counts) + len(busy)
            if waiting >= num_open_streams:
                return 0.0
        return max(0.0, oldest.arrived_s + self.policy.batch_window_s - now_s)

    def _oldest(self, busy: frozenset[int] | set[int]) -> ChunkJob | None:
        """The oldest queued chunk whose stream is not busy."""
        for job in self._queue:
            if id(job.stream) not in busy:
                return job
        return None

    def _forget(self, jobs) -> None:
        """Count ``jobs`` (just taken out of the queue) out of the per-stream counts."""
        counts = self._queued_per_stream
        for job in jobs:
            key = id(job.stream)
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]

    def take_batch(self, busy: frozenset[int] | set[int] = frozenset()) -> list[ChunkJob]:
        """Remove and return the next batch (FIFO, one key, one chunk per stream, no stream in ``busy``). A stream's
        chunks run in the order they came: a chunk left in the queue (another key, or long where the batch is short)
        holds back its stream's later chunks too (a moved stream's live chunk queued behind its history replay
        must not run before it)."""
        oldest = self._oldest(busy)
        if oldest is None:
            return []
        if self._last_long and self._is_long(oldest):  # the oldest short chunk that is its stream's first queued
            oldest = next((j for j in self._heads(busy) if not self._is_long(j)), oldest)
        policy = self.policy
        key, max_batch_size, long = oldest.batch_key, policy.max_batch_size, self._is_long(oldest)
        self._last_long = long
        batch: list[ChunkJob] = []
        seen: set[int] = set(busy)  # streams whose chunks may not join: busy, in the batch, or one of theirs left
        kept: deque[ChunkJob] = deque()
        while self._queue:
            job = self._queue.popleft()
            if (len(batch) < max_batch_size and job.batch_key == key and id(job.stream) not in seen
                    and self._is_long(job) == long):
                batch.append(job)
            else:
                kept.append(job)
                if len(batch) >= max_batch_size:
                    break
            seen.add(id(job.stream))
        kept.extend(self._queue)
        self._queue = kept
        self._forget(batch)
        return batch

    def _heads(self, busy: frozenset[int] | set[int]):
        """Each non-busy stream's first queued chunk, oldest first."""
        seen: set[int] = set(busy)
        for job in self._queue:
            if id(job.stream) not in seen:
                seen.add(id(job.stream))
                yield job

    def _is_long(self, job: ChunkJob) -> bool:
        return bool(self.policy.graph_frames) and self.policy.is_long(job.stream.mode.name, job.decoded_frames)

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
