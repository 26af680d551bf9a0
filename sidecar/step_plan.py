"""The step plan: how one engine step runs, decided once, in one place, before anything runs.

Policy only (no device, no model): ``StepPlanner.plan`` looks at the batch's rows and the graphs' state and
returns a ``StepPlan``: the captured bucket that serves the batch (with its padding) or eager and why, whether the
bucket must be captured first (lazy capture modes), and the time slices of an eager forward. The mechanism
(``engine.Engine.execute``, ``graphs.manager.GraphManager``) takes the plan and trusts it: it never chooses again.
The stepper reads the same plan to decide where the step runs (a capture holds its thread for up to seconds).

Padding tables (``graphs.plan.PaddingTable``: pure, one per mode and set of usable buckets) are built once and
reused until the set changes (a capture failed, an extra bucket was captured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .graphs.plan import BucketKey, PaddingTable, extra_bucket, padding_of, time_slices
from .modes import StreamMode


@dataclass(frozen=True)
class StepPlan:
    mode: StreamMode
    row_frames: tuple[int, ...]  # frames each real row decodes
    bucket: BucketKey | None = None  # the captured step that serves the batch; None: eager
    reason: str = ""  # eager: why (counted in graph_misses); a bucket to capture first: why, should that fail
    capture_first: bool = False  # the bucket is captured before its first replay
    padding_rows: int = 0  # the bucket's rows past the batch's (they use the arena's scratch slot)
    padded_frames: int = 0  # frames of padding over all the bucket's rows
    slices: tuple[tuple[int, int], ...] = ()  # eager: the forward's time slices over ``frames``

    @property
    def num_rows(self) -> int:
        return len(self.row_frames)

    @property
    def frames(self) -> int:
        """The longest row: an eager step pads every row to it."""
        return max(self.row_frames)


class GraphState(Protocol):
    """What the planner reads of the graph mechanism (``graphs.manager.GraphManager``)."""

    def known_buckets(self) -> tuple[BucketKey, ...]: ...
    def usable_buckets(self) -> tuple[BucketKey, ...]: ...
    def is_captured(self, key: BucketKey) -> bool: ...
    def may_capture_extra(self, key: BucketKey) -> bool: ...


def eager_slices(frames: int, max_forward_frames: int) -> tuple[tuple[int, int], ...]:
    """An eager forward over ``frames`` in the fewest time slices of at most ``max_forward_frames`` each."""
    return time_slices(frames, -(-frames // max_forward_frames))


class StepPlanner:
    def __init__(self, graphs: GraphState | None, max_forward_frames: int) -> None:
        self.graphs = graphs
        self.max_forward_frames = max_forward_frames
        self._tables: dict[tuple[str, tuple[BucketKey, ...]], PaddingTable] = {}

    def plan(self, mode: StreamMode, row_frames: list[int] | tuple[int, ...], may_capture: bool = True) -> StepPlan:
        """The plan for a batch whose rows decode ``row_frames`` frames. ``may_capture=False``: a bucket still to
        be captured is not used (the step runs eager, ``capture_deferred``; a later step captures it)."""
        rows = tuple(row_frames)
        key, reason, capture = self._bucket(mode.name, rows) if self.graphs is not None else (None, "no_graphs", False)
        if key is not None and capture and not may_capture:
            key, reason, capture = None, "capture_deferred", False
        if key is None:  # the eager forward's slices: computed for eager plans only (a replay runs its own)
            return StepPlan(mode, rows, reason=reason, slices=eager_slices(max(rows), self.max_forward_frames))
        return StepPlan(mode, rows, key, reason, capture, *padding_of(key, rows))

    def _table(self, mode: str, buckets: tuple[BucketKey, ...]) -> PaddingTable:
        table = self._tables.get((mode, buckets))
        if table is None:  # a new set of buckets: built once
            table = self._tables[(mode, buckets)] = PaddingTable(buckets, mode)
        return table

    def _bucket(self, mode: str, rows: tuple[int, ...]) -> tuple[BucketKey | None, str, bool]:
        """``(bucket, reason, capture first)``: the usable bucket that holds the batch; else an extra bucket to
        capture lazily (keeping the reason no configured bucket held it); else None and the reason."""
        graphs = self.graphs
        choice = self._table(mode, graphs.usable_buckets()).lookup(len(rows), list(rows))
        if choice.key is not None:  # should its capture fail now: its capture failed (not_captured)
            captured = graphs.is_captured(choice.key)
            return choice.key, "" if captured else "not_captured", not captured
        known = graphs.known_buckets()
        if self._table(mode, known).lookup(len(rows), list(rows)).key is not None:
            return None, "not_captured", False  # a configured bucket fits, but its capture failed or was skipped
        if choice.reason in ("frames_too_long", "batch_too_large"):
            largest = max((k for k in known if k.mode == mode), key=lambda k: k.cost, default=None)
            if largest is not None:
                extra = extra_bucket(mode, len(rows), max(rows), largest.batch, self.max_forward_frames)
                if extra is not None and graphs.may_capture_extra(extra):
                    return extra, choice.reason, not graphs.is_captured(extra)
        return None, choice.reason, False
