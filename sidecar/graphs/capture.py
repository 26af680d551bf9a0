"""The device side of capturing one bucket's step: warm it up, measure it, capture it (mechanism only; which
buckets, in how many time slices and within what budget is ``manager.py``'s).

- Warm-up: eager runs of the step on the capture stream (first-call work: algorithm choices such as the
  ``ConvChoice`` timings, compiles); the last one measures the step's live peak (the most bytes its tensors hold
  at once).
- One block for the step's tensors: a capture into a pool smaller than that peak (the temporary profile pool; the
  shared pool's first, largest bucket, or a bucket in time slices beside smaller ones) first allocates and frees one
  block of that size, so the step's tensors are carved out of it and freed ones merge back. Without it each
  upsampling stage's tensors, larger than anything freed before them, took fresh blocks: for the default model's
  b16 step the pool held 1.65x the live peak, with it 1.34x (docs/design-notes.md).
- Profile: the step captured into a temporary pool, its standalone size measured, then released.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch
from torch import Tensor

from .plan import BucketKey


class Routine(Protocol):
    def prime(self, batch: int, frames: int) -> None: ...
    def copy_in(self, batch: int, frames: int, items: list) -> None: ...
    def forward(self, batch: int, frames: int, num_slices: int = 1) -> Tensor: ...
    def copy_out(self, out: Tensor, items: list) -> list: ...


def max_split_bytes(environ: Mapping[str, str]) -> float:
    """The caching allocator's ``max_split_size_mb`` from ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``)
    in bytes: blocks of that size or more are never split. Unlimited (inf) when not set."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in environ.get(name, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "max_split_size_mb" and value.strip().isdigit():
                return int(value) * 2**20
    return float("inf")


class StepCapture:
    """Warm-up, profile and capture of one routine's step on one device."""

    def __init__(self, device: torch.device, warmup_iters: int, environ: Mapping[str, str]) -> None:
        self.device = device
        self.warmup_iters = warmup_iters
        self.stream = torch.cuda.Stream(device)
        self.max_split_bytes = max_split_bytes(environ)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def warmup(self, routine: Routine, key: BucketKey, num_slices: int) -> int:
        """Eager runs of the step (``num_slices`` time slices) on the capture stream; returns the last run's live
        peak in bytes (allocated at once, above what was allocated before it)."""
        peak = 0
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            routine.prime(key.batch, key.frames)
            for _ in range(self.warmup_iters - 1):
                routine.forward(key.batch, key.frames, num_slices)
            if self.warmup_iters:  # the last run, measured
                self.sync()
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
                routine.forward(key.batch, key.frames, num_slices)
                peak = max(0, torch.cuda.max_memory_allocated(self.device) - base)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.sync()
        return peak

    def profile(self, routine: Routine, key: BucketKey, num_slices: int, live_peak_bytes: int) -> int:
        """Standalone graph memory of the step in ``num_slices``: captured into a temporary pool (carved from one
        block of its live peak, as the shared pool's first capture is), measured, released."""
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=self.stream):
            before = self.reserved_bytes()
            self._reserve_block(live_peak_bytes)
            output = routine.forward(key.batch, key.frames, num_slices)
        self.sync()
        nbytes = self.reserved_bytes() - before
        del graph, output
        torch.cuda.empty_cache()
        return max(0, nbytes)

    def capture(self, routine: Routine, key: BucketKey, num_slices: int, pool: Any,
                block_bytes: int) -> tuple[torch.cuda.CUDAGraph, Tensor, int]:
        """The real capture into ``pool``: ``(graph, output, bytes reserved before it)``. ``block_bytes`` > 0: the
        step's tensors are first carved out of one block of that size (see the module docstring)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            before = self.reserved_bytes()  # read inside: entering empties the allocator cache, which hides growth
            self._reserve_block(block_bytes)
            output = routine.forward(key.batch, key.frames, num_slices)
        self.sync()
        return graph, output, before

    def _reserve_block(self, nbytes: int) -> None:
        """Inside a capture: allocate and free one block of ``nbytes`` (0: none), so the pool holds one segment
        the step's tensors are carved from. A block at or over the allocator's max_split_size is never split:
        reserving it would only waste it."""
        if 0 < nbytes < self.max_split_bytes:
            torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # freed at once: back to the pool's blocks
