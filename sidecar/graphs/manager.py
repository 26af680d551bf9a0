"""CUDA graph manager (mechanism): capture, replay and account for graphs; trusts the bucket key it is given.

- Capture largest first into one shared memory pool, after warm-up on the capture stream (``capture.py``). Each
  bucket is first profiled in a temporary pool (its standalone size), then captured for real; both sizes are
  logged and exported. ``max_graph_memory_bytes`` is honoured: a bucket over it whole waits until the buckets that
  fit are captured, then is sized in time slices (``plan.time_slices``) to what is left of the budget, or to the
  largest captured bucket's size when that is more (the shared pool then mostly reuses that bucket's blocks),
  measuring again until it fits (``plan.refine_slices``); a bucket that would still push the pool past the budget
  is dropped, with a message naming it (what its capture grew stays in the shared pool, and stays counted in
  ``pool_bytes``).
- A capture failure leaves that bucket eager, logged with the reason and counted. Nothing captures while
  another stream capture is active on the device.
- ``replay`` copies inputs in, replays, and copies outputs out of graph-owned memory before returning, so the
  next replay cannot overwrite them. An error after replay started propagates: no silent eager retry.
- Capture modes: ``startup`` (all configured buckets at start), ``startup_lazy`` (plus up to ``max_lazy_captures``
  extra buckets on demand), ``lazy`` (configured buckets on first use, extras as above). Which bucket a step uses,
  and whether it is captured first, is the step plan's (``step_plan.py``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .capture import Routine, StepCapture
from .plan import MAX_SLICED_PROFILES, BucketKey, refine_slices, slices_for_budget

log = logging.getLogger(__name__)

CAPTURE_MODES = ("startup", "startup_lazy", "lazy")


@dataclass
class BucketState:
    key: BucketKey
    status: str = "pending"  # pending | captured | eager (capture failed) | skipped (memory budget)
    reason: str = ""
    capture_s: float = 0.0
    profile_bytes: int = 0  # standalone, measured in a temporary pool (of the step as captured)
    num_slices: int = 1  # the step in this many exact-streaming time slices (plan.time_slices), to fit the budget
    pool_bytes: int = 0  # what it added to the shared pool
    live_peak: tuple[int, int] = (0, 0)  # (num_slices, bytes): the step's live peak, measured at its last warm-up
    graph: Any = None
    output: Tensor | None = None
    replays: Any = None  # its graph_replays child (looked up once captured)


class GraphManager:
    def __init__(self, routines: dict[str, Routine], buckets: tuple[BucketKey, ...], device: torch.device,
                 metrics: Any, mode: str = "startup", max_lazy_captures: int = 8,
                 max_graph_memory_bytes: int | None = None, warmup_iters: int = 2) -> None:
        if mode not in CAPTURE_MODES:
            raise ValueError(f"graphs.mode must be one of {CAPTURE_MODES}, got {mode!r}")
        self.routines = routines
        self.device = device
        self.metrics = metrics
        self.capture_mode = mode
        self.max_lazy_captures = max_lazy_captures
        self.max_graph_memory_bytes = max_graph_memory_bytes
        self.buckets: dict[BucketKey, BucketState] = {k: BucketState(k) for k in buckets}
        self.lazy_captures = 0
        self.pool = torch.cuda.graph_pool_handle()
        self.steps = StepCapture(device, warmup_iters, os.environ)
        self.pool_bytes = 0

    # ------------------------------------------------------------------ capture
    def capture_startup(self) -> None:
        if self.capture_mode == "lazy":
            log.info("graphs: lazy mode, %d buckets will be captured on first use", len(self.buckets))
            return
        t0 = time.perf_counter()
        order = sorted(self.buckets, key=lambda k: (-k.cost, -k.batch))
        over_budget = []
        for done, key in enumerate(order):
            log.info("graphs: capturing %d/%d: %s %s", done + 1, len(order), key.mode, key.label)
            if not self._capture(self.buckets[key], may_defer=True):
                over_budget.append(key)
        for key in over_budget:  # sized to what the buckets that fit whole left
            log.info("graphs: capturing %s %s in time slices (over the budget whole)", key.mode, key.label)
            self._capture(self.buckets[key], whole_bytes=self.buckets[key].profile_bytes)
        captured = [b for b in self.buckets.values() if b.status == "captured"]
        log.info("graphs: %d/%d buckets captured in %.1fs, pool %.1f MiB", len(captured), len(self.buckets),
                 time.perf_counter() - t0, self.pool_bytes / 2**20)

    def may_capture_extra(self, key: BucketKey) -> bool:
        """Whether ``capture_extra(key)`` would capture ``key`` (or has): no side effects."""
        if self.capture_mode == "startup" or key.mode not in self.routines:
            return False
        if key in self.buckets:
            return self.buckets[key].status == "captured"
        return self.lazy_captures < self.max_lazy_captures

    def capture_extra(self, key: BucketKey) -> bool:
        """Lazily capture a bucket outside the configured set, within ``max_lazy_captures``."""
        if key in self.buckets or not self.may_capture_extra(key):
            return self.is_captured(key)
        self.lazy_captures += 1
        state = self.buckets[key] = BucketState(key)
        self._capture(state)
        return state.status == "captured"

    def _capture(self, state: BucketState, may_defer: bool = False, whole_bytes: int | None = None) -> bool:
        """Capture ``state``'s bucket (or record why it stays eager or is skipped). False, with nothing done but
        its whole profile, when ``may_defer`` and it is over the budget whole: the caller captures it after the
        buckets that fit, passing that profile as ``whole_bytes``."""
        key = state.key
        labels = {"component": key.mode, "bucket": key.label}
        if torch.cuda.is_current_stream_capturing():
            state.status, state.reason = "eager", "another stream capture is active"
            self.metrics.graph_capture_failures.labels(**labels).inc()
            log.warning("graph %s %s: not captured: %s", key.mode, key.label, state.reason)
            return True
        routine = self.routines[key.mode]
        t0 = time.perf_counter()
        state.num_slices, state.profile_bytes = 1, 0
        budget = self.max_graph_memory_bytes
        try:
            with torch.inference_mode():
                if whole_bytes is None:
                    self._warmup(routine, state, 1)
                    whole_bytes = self._profile(routine, state, 1)
                state.profile_bytes = whole_bytes
                if may_defer and budget is not None and whole_bytes > budget:
                    return False
                over_budget = self._size_for_budget(routine, state, whole_bytes)
                if over_budget is not None:
                    self._skip(state, over_budget)
                    return True
                # into a pool smaller than the step's live peak: its tensors carved out of one block of that size
                block = self._block_bytes(state, state.num_slices) if state.live_peak[1] > self.pool_bytes else 0
                graph, output, before = self.steps.capture(routine, key, state.num_slices, self.pool, block)
                added = self.steps.reserved_bytes() - before
        except Exception as exc:  # capture failure: this bucket stays eager
            self.steps.sync()
            state.num_slices, state.profile_bytes = 1, whole_bytes or 0
            state.status, state.reason = "eager", f"{type(exc).__name__}: {exc}"
            self.metrics.graph_capture_failures.labels(**labels).inc()
            log.warning("graph %s %s: capture failed, bucket stays eager: %s", key.mode, key.label, state.reason)
            return True
        if budget is not None and self.pool_bytes + added > budget:
            del graph, output
            self.steps.sync()
            # what the discarded graph took stays reserved in the shared pool (later captures reuse it): counted
            retained = max(0, self.steps.reserved_bytes() - before)
            self.pool_bytes += retained
            self.metrics.graph_pool_bytes.set(self.pool_bytes)
            state.num_slices, state.profile_bytes = 1, whole_bytes
            self._skip(state, f"would grow graph memory to {(self.pool_bytes - retained + added) / 2**20:.1f} MiB, "
                              f"over max_graph_memory_bytes {budget / 2**20:.1f} MiB ({retained / 2**20:.1f} MiB "
                              f"of it stays in the pool for other buckets)")
            return True
        state.graph, state.output = graph, output
        state.status = "captured"
        state.capture_s = time.perf_counter() - t0
        state.pool_bytes = max(0, added)
        self.pool_bytes += state.pool_bytes
        self.metrics.graph_captures.labels(**labels).inc()
        state.replays = self.metrics.graph_replays.labels(**labels)
        self.metrics.graph_capture_seconds.labels(**labels).set(state.capture_s)
        self.metrics.graph_bytes.labels(**labels).set(state.pool_bytes)
        self.metrics.graph_pool_bytes.set(self.pool_bytes)
        log.info("graph %-6s %-10s captured in %.2fs%s: live peak %.1f MiB, profile %.1f MiB, pool +%.1f MiB "
                 "(total %.1f MiB)", key.mode, key.label, state.capture_s,
                 f" in {state.num_slices} time slices" if state.num_slices > 1 else "", state.live_peak[1] / 2**20,
                 state.profile_bytes / 2**20, state.pool_bytes / 2**20, self.pool_bytes / 2**20)
        return True

    def _skip(self, state: BucketState, reason: str) -> None:
        state.status, state.reason, state.num_slices = "skipped", reason, 1
        log.warning("graph %-6s %-10s skipped: %s; batches of this shape run eager (raise "
                    "graphs.max_graph_memory_bytes to capture it)", state.key.mode, state.key.label, reason)

    def _size_for_budget(self, routine: Routine, state: BucketState, whole_bytes: int) -> str | None:
        """Over the budget whole (``whole_bytes``), the fewest time slices (``state.num_slices``) whose step fits
        ``_slice_target_bytes``: estimated, then measured and refined. Returns why it cannot be captured, or None."""
        key, budget = state.key, self.max_graph_memory_bytes
        if budget is None or whole_bytes <= budget:
            return None
        target = self._slice_target_bytes()
        num_slices = slices_for_budget(whole_bytes, target, key.frames)
        measured, tried = [(key.frames, whole_bytes)], []
        for _ in range(MAX_SLICED_PROFILES):
            if num_slices is None:
                break
            self._warmup(routine, state, num_slices)
            state.num_slices, state.profile_bytes = num_slices, self._profile(routine, state, num_slices)
            tried.append(f"{state.profile_bytes / 2**20:.1f} MiB in {num_slices}")
            if state.profile_bytes <= target:
                return None
            measured.append((-(-key.frames // num_slices), state.profile_bytes))
            num_slices = refine_slices(key.frames, measured, target)
        state.num_slices, state.profile_bytes = 1, whole_bytes
        sliced = f"{', '.join(tried)} time slices" if tried else "too much even in 1-frame time slices"
        return f"needs {whole_bytes / 2**20:.1f} MiB alone ({sliced}; {target / 2**20:.1f} MiB left to it), over " \
               f"max_graph_memory_bytes {budget / 2**20:.1f} MiB"

    def _slice_target_bytes(self) -> int:
        """What a bucket in time slices may take standalone: the budget left, or the largest captured bucket's size
        if more (a step no larger mostly reuses its pool blocks); the check after the real capture decides."""
        budget = self.max_graph_memory_bytes
        largest = max((s.profile_bytes for s in self.buckets.values() if s.status == "captured"), default=0)
        return min(budget, max(budget - self.pool_bytes, largest))

    def _block_bytes(self, state: BucketState, num_slices: int) -> int:
        """The step's live peak, when its last warm-up measured the same slicing (else 0: no block)."""
        measured_slices, nbytes = state.live_peak
        return nbytes if measured_slices == num_slices else 0

    def _warmup(self, routine: Routine, state: BucketState, num_slices: int) -> None:
        state.live_peak = (num_slices, self.steps.warmup(routine, state.key, num_slices))

    def _profile(self, routine: Routine, state: BucketState, num_slices: int) -> int:
        return self.steps.profile(routine, state.key, num_slices, self._block_bytes(state, num_slices))

    # ------------------------------------------------------------------ replay
    def known_buckets(self) -> tuple[BucketKey, ...]:
        """Every bucket: the configured ones and the extras captured so far."""
        return tuple(self.buckets)

    def usable_buckets(self) -> tuple[BucketKey, ...]:
        """Buckets a batch may be dispatched to: captured, or still to be captured on first use."""
        return tuple(k for k, s in self.buckets.items() if s.status in ("captured", "pending"))

    def largest_captured_batch(self, mode: str) -> int:
        """The largest batch that replays a graph whatever its chunk length: for every configured frame count
        some captured bucket must hold that many rows of at least that many frames."""
        captured = [k for k, s in self.buckets.items() if k.mode == mode and s.status == "captured"]
        frame_counts = {k.frames for k in self.buckets if k.mode == mode}
        if not captured or not frame_counts:
            return 0
        return min(max((k.batch for k in captured if k.frames >= f), default=0) for f in frame_counts)

    def longest_captured_frames(self) -> dict[str, int]:
        """Per mode, the most frames a bucket captured (or to be captured on first use) serves: a longer chunk runs
        eager, or in an extra bucket."""
        longest: dict[str, int] = {}
        for key, state in self.buckets.items():
            if state.status in ("captured", "pending"):
                longest[key.mode] = max(longest.get(key.mode, 0), key.frames)
        return longest

    def is_captured(self, key: BucketKey) -> bool:
        state = self.buckets.get(key)
        return state is not None and state.status == "captured"

    def capture(self, key: BucketKey) -> bool:
        """Capture ``key`` now if it is configured and still pending (lazy mode's first use), or an extra bucket
        within ``max_lazy_captures``; True when it is captured afterwards."""
        state = self.buckets.get(key)
        if state is None:
            return self.capture_extra(key)
        if state.status == "pending":
            self._capture(state)
        return state.status == "captured"

    def replay(self, key: BucketKey, items: list) -> list:
        """Replay ``key``'s graph for ``items`` (the plan's bucket: captured, or captured just now) and take each
        row's audio out (host rows copied, synchronously; device rows are views valid until the next replay)."""
        return self.routines[key.mode].copy_out(self.launch(key, items), items)

    def launch(self, key: BucketKey, items: list) -> Tensor:
        """Queue ``key``'s replay for ``items`` on the device, without waiting. Returns the graph's output ``[B,
        T * U]``: overwritten by a later replay (of any bucket: they share one pool), so what is read of it must be
        queued before that one (copies queued on the same stream are)."""
        state = self.buckets[key]
        self.routines[key.mode].copy_in(key.batch, key.frames, items)
        state.graph.replay()
        state.replays.inc()
        return state.output

    def outcomes(self, key: BucketKey, num_rows: int) -> Tensor:
        """After ``replay(key, items)``: the ``forward.ROW_*`` outcome of each of its ``num_rows`` rows,
        ``[num_rows]`` uint8 on the device, valid until the next replay."""
        return self.routines[key.mode].outcomes[:num_rows]

    def summary(self) -> list[dict]:
        return [{"mode": s.key.mode, "bucket": s.key.label, "status": s.status, "reason": s.reason,
                 "capture_s": round(s.capture_s, 3), "profile_bytes": s.profile_bytes, "pool_bytes": s.pool_bytes,
                 "num_slices": s.num_slices}
                for s in sorted(self.buckets.values(), key=lambda s: (s.key.mode, -s.key.cost))]
