"""Timing in-process calls on a device, and the row they make: what every in-process baseline (ours, vLLM-Omni
stock, upstream VoxCPM2) times and reports with, so their figures are taken the same way."""

from __future__ import annotations

import statistics
import time

import torch

from code2wav.sidecar.gc_pauses import FrozenWhile


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` (each waited for on the device), after ``warmup`` calls, with
    Python's heap frozen out of its garbage collector, as the sidecar serves (``sidecar/gc_pauses.py``): otherwise a
    full collection over the loaded models (tens of ms) lands in one of the timed calls now and then, and the row
    times the collector."""
    for _ in range(warmup):
        fn()
    sync_device(device)
    times = []
    with FrozenWhile():
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            sync_device(device)
            times.append(time.perf_counter() - t0)
    return times


SLOW_CALL_RATIO = 1.5
"""A timed call over this many times the median is listed in its row's ``slow_calls`` (which call, how long):
whether the slow ones come first (something left to warm up) or anywhere (the machine) is what a p95 alone hides."""


def slow_calls(times_s: list[float]) -> list[list[float]]:
    """``[index, ms]`` of each call of ``times_s`` (in call order) over ``SLOW_CALL_RATIO`` x their median."""
    limit_s = SLOW_CALL_RATIO * statistics.median(times_s)
    return [[index, round(t * 1e3, 3)] for index, t in enumerate(times_s) if t > limit_s]


def baseline_row(name: str, batch: int, new_frames: int, times_s: list[float], model) -> dict:
    """One in-process baseline's row (the report's ``baselines`` schema): p50/p95 of ``times_s`` (in call order)
    in ms, audio-s/s at p50, for ``batch`` chunks of ``new_frames`` frames of ``model`` (its frame size and rate),
    and the calls far slower than the median (``slow_calls``)."""
    ordered = sorted(times_s)
    p50 = statistics.median(ordered)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    audio_s = batch * new_frames * model.samples_per_frame / model.sample_rate_hz
    return {"name": name, "batch": batch, "new_frames": new_frames, "latency_ms_p50": p50 * 1e3,
            "latency_ms_p95": p95 * 1e3, "audio_s_per_s": audio_s / p50, "iters": len(ordered),
            "slow_calls": slow_calls(times_s)}


def print_row(row: dict, name_width: int = 24) -> None:
    """A baseline row as the bench prints it while it runs."""
    print(f"{row['name']:<{name_width}} batch {row['batch']:>2} x {row['new_frames']:>2} frames: p50 "
          f"{row['latency_ms_p50']:8.2f} ms p95 {row['latency_ms_p95']:8.2f} ms  {row['audio_s_per_s']:8.1f} "
          f"audio-s/s{_slow_text(row.get('slow_calls') or [])}", flush=True)


def _slow_text(calls: list[list[float]]) -> str:
    """``  slow calls 3: 12.30 ms, ...`` (call indices from 0), or nothing."""
    return "" if not calls else "  slow calls " + ", ".join(f"{int(i)}: {ms:.2f} ms" for i, ms in calls)
