"""The compiled step: one more implementation of a graph routine, its forward run through ``torch.compile``.

``CompiledRoutine`` wraps a routine (``StreamRoutine``): ``prime``, ``copy_in`` and ``copy_out`` are the wrapped
routine's own (same static buffers), only ``forward`` is compiled. Capture, the graph pool and replay stay
the graph manager's: the manager warms the compiled forward up (this is when it compiles, per bucket shape,
``dynamic=False``), then captures it in a CUDA graph like the plain forward. Inductor's kernels are Triton
kernels and extern calls (cuDNN convolutions, cuBLAS), all capturable.

Compile cache: torch's own on-disk caches (Inductor's FX graph cache, its Triton kernels) live under
``TORCHINDUCTOR_CACHE_DIR``; ``configure_compile_cache`` points it at ``graphs.compile_cache_dir`` before the
first compile, so a restart with the same directory (a volume in compose and k8s) skips code generation.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from .plan import MAX_SLICED_PROFILES

log = logging.getLogger(__name__)

COMPILE_MODE = "default"
"""Inductor's default mode: no autotuning at capture time (``max-autotune`` benchmarks kernels for minutes)."""


def configure_compile_cache(cache_dir: str | None) -> str:
    """Point torch's compile caches at ``cache_dir`` (created 0700); None keeps torch's default. Must run before
    the first compile: Inductor reads the directory when it first writes a cache entry. Returns the directory
    in use."""
    if cache_dir is not None:
        path = Path(cache_dir).expanduser()
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"graphs.compile_cache_dir {cache_dir!r} cannot be created ({exc}); give a writable "
                             f"directory or null for torch's default") from exc
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    from torch._inductor.runtime.runtime_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


def allow_recompiles(num_shapes: int) -> None:
    """One compiled forward serves every bucket shape of a routine (``dynamic=False``: one specialisation per
    ``(batch, frames)``); Dynamo stops recompiling a function after ``recompile_limit`` shapes (8 by default)
    and would silently run the rest eager-through-Dynamo, so raise the limit to the bucket count."""
    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), num_shapes + 2))
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * (num_shapes + 2))


class CompiledRoutine:
    """A routine whose ``forward(batch, frames)`` is compiled; everything else is the wrapped routine's."""

    def __init__(self, routine: Any, name: str, num_shapes: int, mode: str = COMPILE_MODE,
                 dynamic: bool = False) -> None:
        """``dynamic=False``: one specialisation per bucket shape; ``True``: symbolic shapes, one compile serves
        every bucket (fewer compiles at start-up, kernels not specialised to the shape)."""
        self.routine = routine
        self.name = name
        self.mode = mode
        # a bucket over the graph memory budget compiles again for each slice count it tries
        allow_recompiles((1 + MAX_SLICED_PROFILES) * num_shapes)
        self._forward: Callable[[int, int, int], Tensor] = torch.compile(routine.forward, mode=mode, dynamic=dynamic,
                                                                    fullgraph=True)
        # per (batch, frames, num_slices) compiled: its first call (trace + compile + run)
        self.compile_s: dict[tuple[int, int, int], float] = {}

    @property
    def max_batch(self) -> int:
        return self.routine.max_batch

    @property
    def max_frames(self) -> int:
        return self.routine.max_frames

    def prime(self, batch: int, frames: int) -> None:
        self.routine.prime(batch, frames)

    def copy_in(self, batch: int, frames: int, items: list) -> None:
        self.routine.copy_in(batch, frames, items)

    def copy_out(self, out: Tensor, items: list) -> list:
        return self.routine.copy_out(out, items)

    def forward(self, batch: int, frames: int, num_slices: int = 1) -> Tensor:
        """The compiled forward; the first call of a shape (and slice count) compiles it (seconds) and is
        timed."""
        shape = (batch, frames, num_slices)
        if shape in self.compile_s:
            return self._forward(batch, frames, num_slices)
        t0 = time.perf_counter()
        out = self._forward(batch, frames, num_slices)  # [batch, frames * U]
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.compile_s[shape] = time.perf_counter() - t0
        log.info("compile %-6s b%dxt%d%s: %.1fs", self.name, batch, frames,
                 f" in {num_slices} time slices" if num_slices > 1 else "", self.compile_s[shape])
        return out


def compile_routines(routines: dict[str, Any], bucket_modes: list[str], cache_dir: str | None,
                     max_lazy_captures: int = 0) -> dict[str, Any]:
    """The compiled implementation of each routine, for the manager's ``compiled`` argument
    (``bucket_modes``: the mode of every configured bucket; with ``max_lazy_captures`` they size Dynamo's
    recompile limit, which counts the specialisations of ``StreamRoutine.forward`` across all routines). A lazy
    capture compiles too: tens of seconds on the calling thread when the cache is cold."""
    used = configure_compile_cache(cache_dir)
    log.info("graphs: compiling the step per bucket (torch.compile, mode %s), cache %s", COMPILE_MODE, used)
    num_shapes = len(bucket_modes) + max_lazy_captures * len(routines)
    return {mode: CompiledRoutine(routine, mode, num_shapes) for mode, routine in routines.items()}
