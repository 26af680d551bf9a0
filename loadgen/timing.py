"""Timing in-process calls on a device: what every in-process baseline (ours, vLLM-Omni stock, upstream VoxCPM2)
times with, so their figures are taken the same way."""

from __future__ import annotations

import time

import torch


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` (each waited for on the device), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync_device(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return times
