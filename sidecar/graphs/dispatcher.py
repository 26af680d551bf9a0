"""The one answer to "which captured step serves this batch": bucket choice, padding, lazy capture, and the
eager fallback with its reason (counted in ``graph_misses``).

Policy (pure, ``plan.py``): the padding tables, built once per set of usable buckets. Mechanism
(``manager.py``): capture and replay. Capture at start-up is the explicit ``capture_startup`` step (progress
logged per bucket: time, memory); at run time a capture happens only in ``run`` when the choice says
``needs_capture`` and the caller allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .manager import GraphManager
from .plan import BucketKey, PaddingTable, extra_bucket


@dataclass(frozen=True)
class GraphChoice:
    """The graph bucket a batch would replay (``needs_capture``: captured on first use), or None and why not."""

    key: BucketKey | None
    reason: str = ""
    needs_capture: bool = False


class GraphDispatcher:
    def __init__(self, manager: GraphManager, max_forward_frames: int, metrics: Any = None) -> None:
        self.manager = manager
        self.max_forward_frames = max_forward_frames
        self.metrics = metrics
        self._tables: dict[tuple[str, tuple[BucketKey, ...]], PaddingTable] = {}

    def capture_startup(self) -> None:
        """The start-up capture step (nothing in ``lazy`` mode)."""
        self.manager.capture_startup()

    @property
    def captures_on_demand(self) -> bool:
        """Whether a batch may still need a graph captured first (graphs in ``lazy`` or ``startup_lazy`` mode)."""
        return self.manager.mode != "startup"

    def largest_captured_batch(self, mode: str) -> int:
        return self.manager.largest_captured_batch(mode)

    def _table(self, mode: str, buckets: tuple[BucketKey, ...]) -> PaddingTable:
        key = (mode, buckets)
        table = self._tables.get(key)
        if table is None:  # a new set of buckets (a capture failed or an extra was captured): built once
            table = self._tables[key] = PaddingTable(buckets, mode)
        return table

    def choose(self, mode: str, row_frames: list[int]) -> GraphChoice:
        """Policy, no side effects: the bucket a batch with rows of ``row_frames`` frames would replay, and
        whether it must be captured first; or no bucket, and why the batch would run eager."""
        manager = self.manager
        num_rows = len(row_frames)
        choice = self._table(mode, manager.usable_buckets()).lookup(num_rows, row_frames)
        if choice.key is not None:
            return GraphChoice(choice.key, needs_capture=not manager.is_captured(choice.key))
        if self._table(mode, tuple(manager.buckets)).lookup(num_rows, row_frames).key is not None:
            return GraphChoice(None, "not_captured")  # a configured bucket fits, but its capture failed or was skipped
        if choice.reason in ("frames_too_long", "batch_too_large"):
            largest = max((k for k in manager.buckets if k.mode == mode), key=lambda k: k.cost, default=None)
            if largest is not None:
                extra = extra_bucket(mode, num_rows, max(row_frames), largest.batch, self.max_forward_frames)
                if extra is not None and manager.may_capture_extra(extra):
                    return GraphChoice(extra, choice.reason, needs_capture=not manager.is_captured(extra))
        return GraphChoice(None, choice.reason)

    def run(self, mode: str, items: list, may_capture: bool) -> list[Tensor] | None:
        """Replay the chosen bucket for ``items`` (capturing it first when needed and ``may_capture``); None: run
        eager (the reason counted). An error after replay started propagates: no silent eager retry."""
        choice = self.choose(mode, [it.codes.shape[1] for it in items])
        key, reason = choice.key, choice.reason
        if key is not None and choice.needs_capture and not may_capture:
            key, reason = None, "capture_deferred"  # captured by the next such batch on the worker thread
        if key is not None and choice.needs_capture and not self.manager.capture(key):
            # an extra keeps the reason no configured bucket held the batch; a configured one failed just now
            reason = reason if key not in self.manager.buckets or reason else "not_captured"
            key = None
        if key is None:
            if self.metrics is not None:
                self.metrics.graph_misses.labels(component=mode, reason=reason).inc()
            return None
        return self.manager.run(key, items)
