"""``bench --stages`` on CUDA, its last table: the hand-off as the GPU sees it, armed chunks against codes events.

A talker makes its codes on the GPU and hands them over before they exist there. Here one stream at concurrency 1
does that for each chunk: its stream is busy for ``busy_ms`` (a stand-in for the talker's step, ``torch.cuda._sleep``),
then makes the chunk's codes (a copy on the same stream, after the busy work) and records event ``made``; the caller
calls ``decode`` at once, while the GPU is still busy, and records event ``ready`` on its stream once the audio is
ordered there (the client makes the stream wait for the sidecar's audio event). ``made.elapsed_time(ready)`` is the GPU
timeline of the hand-off: from the codes existing to their audio existing, every CPU step of both processes that is
on that path included.

- Armed (``codes_token``): the message reached the sidecar during the busy work, and its step is already queued
  behind a GPU wait for the codes' doorbell: the gap is the step itself and the audio's copy.
- Codes events (``ipc_armed=False``): the sidecar polls the client's event from the host; the step is planned,
  staged and launched only once it saw the event complete: the gap adds that CPU round trip.

The in-process step of the same shape (``--scenario inprocess``, b1 x ``chunk_frames``) is the floor of both.
"""

from __future__ import annotations

import statistics

import torch

from code2wav.client import SidecarClient

from .inputs import InputContract, synthetic_inputs

__all__ = ["sleep_cycles", "measure_handoff", "format_handoff"]


def sleep_cycles(ms: float, device: torch.device) -> int:
    """``torch.cuda._sleep`` cycles that keep ``device`` busy for about ``ms`` milliseconds (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
    return max(1, int(10_000_000 * ms / start.elapsed_time(end)))


def measure_handoff(address: str, device: torch.device, armed: bool, num_chunks: int, warmup: int,
                    chunk_frames: int, busy_ms: float) -> dict:
    """One stream of ``warmup + num_chunks`` chunks handed over before their codes exist (see the module); the
    percentiles of the GPU gap ``made -> ready`` over the timed chunks, in microseconds."""
    busy = sleep_cycles(busy_ms, device)
    gaps_us = []
    with torch.cuda.device(device), SidecarClient(address, timeout_s=120, ipc_armed=armed) as client:
        inputs = synthetic_inputs(InputContract.of(client.models[0]), (warmup + num_chunks) * chunk_frames,
                                  seed=1).to(device)  # [Q|D, T]
        stream = client.open_stream(f"handoff-{'armed' if armed else 'events'}")
        for i in range(warmup + num_chunks):
            made, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(busy)  # the talker's step
            codes = inputs[:, i * chunk_frames:(i + 1) * chunk_frames].clone()  # [Q|D, n]: made after it
            made.record()
            audio = stream.decode(codes, final=i == warmup + num_chunks - 1)  # sent while the GPU is still busy
            ready.record()  # the stream waits for the sidecar's audio event before this
            ready.synchronize()
            if i >= warmup:
                gaps_us.append(1000.0 * made.elapsed_time(ready))
            del audio
        stats = client.ipc_stats
    if stats.get("ipc_chunks", 0) != warmup + num_chunks or stats.get("ipc_armed", 0) != (warmup + num_chunks
                                                                                       if armed else 0):
        raise RuntimeError(f"the {'armed' if armed else 'codes events'} hand-off did not go as asked: {stats}")
    gaps_us.sort()
    return {"armed": armed, "busy_ms": busy_ms, "chunks": len(gaps_us), "ipc_chunks": stats["ipc_chunks"],
            "ipc_armed": stats.get("ipc_armed", 0),
            "p50_us": round(statistics.median(gaps_us), 1),
            "p90_us": round(gaps_us[int(0.9 * (len(gaps_us) - 1))], 1),
            "mean_us": round(statistics.fmean(gaps_us), 1)}


def format_handoff(rows: list[dict], title: str) -> str:
    """The table: per kind, the GPU gap from codes made to audio ready, and the ratio to the armed one."""
    armed = next((row for row in rows if row["armed"]), None)
    lines = [title, f"{'hand-off':<16}{'p50 us':>10}{'p90 us':>10}{'mean us':>10}{'p50 / armed':>13}"]
    for row in rows:
        ratio = f"{row['p50_us'] / armed['p50_us']:.2f}x" if armed else "-"
        name = "armed" if row["armed"] else "codes events"
        lines.append(f"{name:<16}{row['p50_us']:>10.1f}{row['p90_us']:>10.1f}{row['mean_us']:>10.1f}{ratio:>13}")
    return "\n".join(lines)
