"""Whether a reduced dtype (bfloat16, float16) is fast on this CPU: a start-up probe, and the warning when not.

CPUs with native bfloat16 (AVX512-BF16, AMX) run it faster than float32; others emulate it, many times slower.
Measured with ``code2wav-sidecar decode --model default --device cpu --time`` on 1 x 25 frames (a 2-core Xeon
with AMX; its AVX2 path forced with ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``): AVX2 float32 1.0 s,
bfloat16 73.8 s (71x slower, "0.0x real time"); AMX float32 0.8 s, bfloat16 0.6 s (and 126 frames 7.7 s vs
3.0 s). The probe times one conv1d like the decoder's (256 channels, kernel 7, 200 frames) in both dtypes on one
thread (on a shared 2-core machine a 2-thread pool's conv took anywhere from 1 to 30 ms, waiting for a descheduled
thread): on that AVX2 path 1.9 ms in float32 and 51 ms in bfloat16 (27x), on AMX 1.4 ms and 0.5 ms."""

from __future__ import annotations

import time

import torch

SLOW_RATIO = 2.0  # a reduced dtype slower than this many times float32 is worth a warning
PROBE_REPS = 4


def _conv_seconds(dtype: torch.dtype) -> float:
    """Best of ``PROBE_REPS`` timed conv1d calls ``[1, 256, 200]`` * ``[256, 256, 7]`` in ``dtype`` (one warm-up)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, 200, generator=gen).to(dtype)  # [B, C, T]
    w = torch.randn(256, 256, 7, generator=gen).to(dtype)  # [C_out, C_in, K]
    best_s = float("inf")
    with torch.inference_mode():
        torch.nn.functional.conv1d(x, w, padding=3)  # [1, 256, 200]
        for _ in range(PROBE_REPS):
            t0 = time.perf_counter()
            torch.nn.functional.conv1d(x, w, padding=3)  # [1, 256, 200]
            best_s = min(best_s, time.perf_counter() - t0)
    return best_s


def cpu_slowdown(dtype: str) -> float:
    """How many times slower than float32 ``dtype`` runs the probe conv on this CPU (under 1: faster), measured on
    one thread (torch's pool is restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _conv_seconds(getattr(torch, dtype)) / _conv_seconds(torch.float32)
    finally:
        torch.set_num_threads(threads)


def cpu_dtype_warning(device_type: str, dtype: str) -> str | None:
    """The start-up warning for a reduced ``dtype`` on the CPU when this CPU runs it slowly, else None."""
    if device_type != "cpu" or dtype == "float32":
        return None
    ratio = cpu_slowdown(dtype)
    if ratio < SLOW_RATIO:
        return None
    return (f"--dtype {dtype} on this CPU: a conv probe at start-up ran {ratio:.0f}x slower than float32 (no native "
            f"{dtype} here), and decoding slows alike (measured on an AVX2 CPU: 1 x 25 frames took 74 s in bfloat16 "
            "vs 1.0 s in float32); use --dtype float32 on the CPU")
