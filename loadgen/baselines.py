"""In-process baselines on the same device and model as the sidecar under test, so every sidecar figure is
also a ratio against them:

- ``window-eager-b1``: what vLLM-Omni does per request today: each 25-frame chunk decoded again with 25
  frames of left context (a 50-frame stateless forward), batch 1, eager.
- ``exact-eager-b1``: the sidecar's exact mode without the wire: 25 new frames against carried state.
- ``exact-eager-bN``: the same at batch N (throughput class of cross-request batching).
- ``exact-graph-bN`` (CUDA only): the same through a captured CUDA graph.
- ``exact-graph-torchops-bN`` (CUDA, a family with fused kernels): the same graph with the family's Triton kernels
  off (``engine.fused_kernels: false``), so the kernels' gain is a ratio in one run.
- ``exact-graph-cublas-bN`` (CUDA, float32, a family whose GEMMs can run ``kernels/matmul.py``'s 3xTF32 kernel): the
  same graph with the other kernels on and every GEMM on cuBLAS, so that kernel's own gain is a ratio in one run.

``frames`` (the bench's ``--baseline-frames``) adds the exact rows at other chunk sizes; a row at F frames other
than ``new_frames`` is named with ``-tF`` (``exact-graph-b64-t25``), so the default names stay as above.

- ``replay-eager-bN-tH`` (when ``frames`` holds the model's ``history_frames`` H): the same H frames sent as one
  chunk that is all context, as a client pool replays a stream's history into a fresh stream after a failover: no
  audio, the new state only (``StreamBatch.audio`` False). Beside ``exact-eager-bN-tH`` it gives what decoding the
  state only saves; its ``audio_s_per_s`` counts the history's seconds replayed per second.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.kernels.matmul_choice import matmul_choices
from code2wav.sidecar.models import LoadedModel
from code2wav.sidecar.state_store import StateArena

from .inputs import InputContract, synthetic_inputs
from .timing import baseline_row, time_calls


@dataclass
class BaselineResult:
    name: str
    batch: int
    new_frames: int
    latency_ms_p50: float
    latency_ms_p95: float
    audio_s_per_s: float
    iters: int
    slow_calls: list[list[float]]  # [index, ms] of the calls over 1.5x the median (timing.slow_calls)


def _result(name: str, batch: int, new_frames: int, times_s: list[float], model: LoadedModel) -> BaselineResult:
    return BaselineResult(**baseline_row(name, batch, new_frames, times_s, model))


def _suffix(frames: int, new_frames: int) -> str:
    return "" if frames == new_frames else f"-t{frames}"


def run_baselines(model: LoadedModel, new_frames: int = 25, left_context_frames: int = 25, iters: int = 20,
                  warmup: int = 3, batch_sizes: tuple[int, ...] = (1,),
                  frames: tuple[int, ...] | None = None) -> list[BaselineResult]:
    """``frames``: chunk sizes of the exact rows (None: ``new_frames`` only)."""
    frames = tuple(dict.fromkeys(frames or (new_frames,)))
    arena = StateArena(model.module.state_layout(), max(batch_sizes), model.dtype, model.device)
    engine = Engine(model, arena, max_forward_frames=max(256, new_frames + left_context_frames, *frames))
    total_frames = max(new_frames + left_context_frames, *frames)
    codes = synthetic_inputs(InputContract.of(model), total_frames, seed=1)  # [C, T]
    results = []

    window = [DecodeItem(codes=codes[:, :left_context_frames + new_frames], slot=None,
                         skip_frames=left_context_frames)]  # [C, ctx + new]: longer --baseline-frames widen codes
    times = time_calls(lambda: engine.decode(window), model.device, iters, warmup)
    results.append(_result("window-eager-b1", 1, new_frames, times, model))

    first = [DecodeItem(codes=codes[:, :1], slot=arena.allocate(), skip_frames=0)]  # a vLLM-Omni first chunk
    times = time_calls(lambda: engine.decode(first), model.device, iters, warmup)
    results.append(_result("exact-eager-b1-t1", 1, 1, times, model))
    arena.release(first[0].slot)

    for num_frames in frames:
        for batch in batch_sizes:
            name = f"exact-eager-b{batch}" + _suffix(num_frames, new_frames)
            if any(r.name == name for r in results):
                continue  # 1 frame at batch 1 is the first-chunk row above
            kinds = [(0, "exact")]  # (context frames, row kind)
            if num_frames == model.contract.history_frames:  # a history replay too: every frame context
                kinds.insert(0, (num_frames, "replay"))
            for skip, kind in kinds:
                slots = [arena.allocate() for _ in range(batch)]
                items = [DecodeItem(codes=codes[:, :num_frames], slot=s, skip_frames=skip) for s in slots]
                times = time_calls(lambda: engine.decode(items), model.device, iters, warmup)
                results.append(_result(name.replace("exact", kind, 1), batch, num_frames, times, model))
                for s in slots:
                    arena.release(s)
    if model.device.type == "cuda":
        results += _graph_baselines(model, arena, codes, new_frames, iters, warmup, batch_sizes, frames)
    return results


def _graph_baselines(model: LoadedModel, arena: StateArena, codes, new_frames: int, iters: int, warmup: int,
                     batch_sizes: tuple[int, ...], frames: tuple[int, ...] = ()) -> list[BaselineResult]:
    frames = frames or (new_frames,)
    buckets = tuple(dict.fromkeys([(b, f) for f in frames for b in batch_sizes] + [(1, 1)]))

    def name(batch: int, num_frames: int, kernels: str = "") -> str:
        return f"exact-graph{kernels}-b{batch}" + ("-t1" if num_frames == 1 else _suffix(num_frames, new_frames))

    rows = _captured_rows(model, arena, codes, iters, warmup, buckets, name)
    if model.fused_kernels:  # the same graphs with torch ops instead of the family's Triton kernels, same run
        with _torch_ops(model):
            rows += _captured_rows(model, arena, codes, iters, warmup, buckets,
                                   lambda b, f: name(b, f, "-torchops"))
    if model.fused_kernels and model.dtype == torch.float32 and matmul_choices(model.module):
        with cublas_gemms(model.module):  # ... and with only the GEMM kernel off
            rows += _captured_rows(model, arena, codes, iters, warmup, buckets,
                                   lambda b, f: name(b, f, "-cublas"))
    return rows


@contextmanager
def cublas_gemms(module: torch.nn.Module):
    """Every GEMM choice of ``module`` on cuBLAS inside the block (graphs captured there keep cuBLAS), as before
    after; the family's other kernels stay as they are."""
    choices = matmul_choices(module)
    before = [c.kernels for c in choices]
    for c in choices:
        c.kernels = False
    try:
        yield
    finally:
        for c, kernels in zip(choices, before):
            c.kernels = kernels


@contextmanager
def _torch_ops(model: LoadedModel):
    """The family's fused kernels off inside the block (graphs captured there keep torch ops), on again after."""
    model.family.use_fused_kernels(model.module, False)
    try:
        yield
    finally:
        model.family.use_fused_kernels(model.module, True)


def _captured_rows(model: LoadedModel, arena: StateArena, codes, iters: int, warmup: int,
                   shapes: tuple[tuple[int, int], ...], name) -> list[BaselineResult]:
    """One row per ``(batch, frames)`` shape captured in a CUDA graph by the sidecar's own ``GraphManager``."""
    from prometheus_client import CollectorRegistry

    from code2wav.sidecar.graphs.manager import GraphManager
    from code2wav.sidecar.graphs.plan import BucketKey
    from code2wav.sidecar.graphs.routine import StreamRoutine
    from code2wav.sidecar.metrics import Metrics

    buckets = tuple(BucketKey("exact", b, f) for b, f in shapes)
    routine = StreamRoutine(model, arena, max(k.batch for k in buckets), max(k.frames for k in buckets))
    manager = GraphManager({"exact": routine}, buckets, model.device, Metrics(CollectorRegistry()),
                           max_graph_memory_bytes=None)  # every shape asked for
    manager.capture_startup()
    results = []
    for key in buckets:
        if not manager.is_captured(key):
            continue
        slots = [arena.allocate() for _ in range(key.batch)]
        items = [DecodeItem(codes=codes[:, :key.frames], slot=s, skip_frames=0) for s in slots]
        times = time_calls(lambda: manager.replay(key, items), model.device, iters, warmup)
        results.append(_result(name(key.batch, key.frames), key.batch, key.frames, times, model))
        for s in slots:
            arena.release(s)
    return results


def profile_kernels(model: LoadedModel, batch: int, new_frames: int, row_limit: int = 15) -> str:
    """Where the time of one eager exact step goes: ``profile.py``'s per-kernel table (the ``profile`` command's),
    with the family's fused kernels on, and also with torch ops, for before/after in one run."""
    from .profile import format_table, profile_step

    if not model.fused_kernels:
        return format_table(profile_step(model, batch, new_frames), row_limit)
    fused = format_table(profile_step(model, batch, new_frames), row_limit)
    with _torch_ops(model):
        plain = format_table(profile_step(model, batch, new_frames), row_limit)
    return f"fused kernels (the default):\n{fused}\ntorch ops (engine.fused_kernels: false):\n{plain}"
