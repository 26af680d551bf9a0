"""Compiled exact step vs plain graph vs eager, in-process, on one GPU (issue 21's profile and bench figures).

Builds the real pieces (``load_model``, ``StateArena``, ``StreamRoutine``, ``GraphManager``, ``CompiledRoutine``)
and prints, for the bf16 default model:
- FLOPs per audio-second (``torch.utils.flop_counter`` on ``forward_stream``) and the compute ceiling at
  ``PEAK_FLOPS`` (790e12 bf16 FLOP/s, the H200's dense bf16 figure, an assumption: set PEAK_FLOPS to change it);
- per batch (``BATCHES``, default 1,16,64) at 25 frames: device time of one replay of the plain graph and of
  the compiled graph, one eager step, audio-s/s and the compute-ceiling fraction, compile and capture time,
  graph pool bytes per bucket (one shared pool, largest first);
- torch.profiler top kernels by device time for one eager (``EAGER_PROFILE=0`` skips) and one compiled
  (uncaptured) step at ``PROFILE`` batches (default 16,1);
- float32 with TF32 off: compiled graph vs eager step, same inputs and state, max abs error of the audio and
  the new state (``FP32=0`` skips);
- bf16 SNR of the audio against float32 for the plain graph and the compiled graph (``SNR=0`` skips).
``STARTUP=b1xt1,b1xt25,...`` instead times the compile + capture of that bucket set in this process and exits
(run it twice with the same ``TORCHINDUCTOR_CACHE_DIR`` for cold and warm).
``MODEL`` (default ``default``) and ``FRAMES`` (default 25) pick another model and chunk size, e.g.
``MODEL=voxcpm2-default FRAMES=4`` for VoxCPM2's 4-frame patches.
Run from the repository root: ``python loadgen/probes/compile_profile.py``.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from code2wav.sidecar.graphs.compiled import CompiledRoutine, configure_compile_cache
from code2wav.sidecar.graphs.manager import GraphManager
from code2wav.sidecar.graphs.plan import BucketKey
from code2wav.sidecar.metrics import Metrics
from code2wav.sidecar.models import configure_cuda, load_model
from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.state_store import StateArena
from code2wav.sidecar.work import DecodeItem

from code2wav.loadgen.flops import flops_per_audio_s
from code2wav.loadgen.inputs import InputContract, synthetic_inputs

FRAMES = int(os.environ.get("FRAMES", "25"))  # new frames per chunk (VoxCPM2's LM patch: 4)
MODEL = os.environ.get("MODEL", "default")  # a --model spec, e.g. voxcpm2-default
PEAK_FLOPS = float(os.environ.get("PEAK_FLOPS", "790e12"))
NUM_SLOTS = 160


def env_ints(name: str, default: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, default).split(",") if x]


def device_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def make_items(model, batch: int, frames: int, seed: int) -> list[DecodeItem]:
    contract = InputContract.of(model)
    return [DecodeItem(synthetic_inputs(contract, frames, seed=seed * 1000 + b), b, 0) for b in range(batch)]


def build(dtype: str, batches: list[int], compile_: bool, frames: int = FRAMES):
    model = load_model(MODEL, torch.device("cuda"), dtype)
    arena = StateArena(model.module.state_layout(), NUM_SLOTS, model.dtype, model.device)
    plain = StreamRoutine(model, arena, max(batches), frames)
    buckets = tuple(BucketKey("exact", b, frames) for b in batches)
    compiled = {"exact": CompiledRoutine(plain, "exact", len(buckets))} if compile_ else None
    manager = GraphManager({"exact": plain}, buckets, model.device, Metrics(), max_graph_memory_bytes=None,
                           compiled=compiled)
    return model, arena, plain, manager


def top_kernels(fn, label: str, n: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA or
              getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total_us = sum(e.self_device_time_total for e in events)
    count = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\n-- top kernels, {label}: device total {total_us / 1e3:.2f} ms, {count} kernel launches")
    for e in events[:n]:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms {100 * e.self_device_time_total / max(total_us, 1):5.1f}% "
              f"x{e.count:<4d} {e.key[:110]}")


def step_table(model, plain, manager, batches: list[int], flops: float) -> dict:
    spf, sr = model.samples_per_frame, model.sample_rate_hz
    rows = {}
    for b in batches:
        key = BucketKey("exact", b, FRAMES)
        state = manager.buckets[key]
        plain.copy_in(b, FRAMES, make_items(model, b, FRAMES, seed=b))
        replay_ms = device_ms(state.graph.replay) if state.status == "captured" else float("nan")
        with torch.inference_mode():
            eager_ms = device_ms(lambda: plain.forward(b, FRAMES), iters=5)
        audio_s = b * FRAMES * spf / sr
        rows[b] = (replay_ms, eager_ms, state.capture_s, state.pool_bytes, state.status)
        rate = audio_s / (replay_ms / 1e3)
        print(f"  b{b:<3d} graph {replay_ms:8.3f} ms  eager {eager_ms:8.3f} ms  {rate:8.0f} audio-s/s  "
              f"ceiling {100 * rate * flops / PEAK_FLOPS:5.1f}%  capture {state.capture_s:6.1f} s  "
              f"pool +{state.pool_bytes / 2**20:7.1f} MiB  {state.status}")
    return rows


def fp32_check(batch: int = 4) -> None:
    configure_cuda(allow_tf32=False)
    model, arena, plain, manager = build("float32", [batch], compile_=True)
    manager.capture_startup()
    key = BucketKey("exact", batch, FRAMES)
    assert manager.is_captured(key), manager.summary()
    items = make_items(model, batch, FRAMES, seed=7)
    with torch.inference_mode():
        plain.copy_in(batch, FRAMES, items)
        plain.forward(batch, FRAMES)  # a first chunk: real, non-zero state in the arena
        items = make_items(model, batch, FRAMES, seed=8)
        saved = {k: t.clone() for k, t in arena.tensors.items()}, arena.positions.clone()
        plain.copy_in(batch, FRAMES, items)
        eager = plain.forward(batch, FRAMES).clone()  # [B, T * U]
        eager_state = {k: t.clone() for k, t in arena.tensors.items()}
        for k, t in arena.tensors.items():
            t.copy_(saved[0][k])
        arena.positions.copy_(saved[1])
        out = manager.run(key, items)
    graph = torch.stack([o.to(eager.device) for o in out])  # [B, T * U]
    audio_err = (graph - eager).abs().max().item()
    state_err = max((arena.tensors[k] - eager_state[k]).abs().max().item() for k in eager_state)
    print(f"\nfp32 TF32 off, b{batch}xt{FRAMES}, compiled graph vs eager: audio max abs err {audio_err:.2e}, "
          f"state max abs err {state_err:.2e} (compiled: {manager.summary()[0]['compiled']})")


def snr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    noise = (test.double() - ref.double()).pow(2).sum()
    return (10 * torch.log10(ref.double().pow(2).sum() / noise.clamp_min(1e-30))).item()


def audio_of(dtype: str, compile_: bool, batch: int, chunks: int = 3) -> torch.Tensor:
    """Three ``FRAMES``-frame chunks of ``batch`` streams through the captured graph: ``[B, chunks * T * U]``."""
    model, arena, plain, manager = build(dtype, [batch], compile_)
    manager.capture_startup()
    key = BucketKey("exact", batch, FRAMES)
    outs = []
    for c in range(chunks):
        outs.append(torch.stack(manager.run(key, make_items(model, batch, FRAMES, seed=100 + c))))
    return torch.cat(outs, dim=1)


def startup(spec: str) -> None:
    cache = configure_compile_cache(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    keys = []
    for label in spec.split(","):
        b, t = label.lstrip("b").split("xt")
        keys.append(BucketKey("exact", int(b), int(t)))
    configure_cuda(False)
    t0 = time.perf_counter()
    model = load_model(MODEL, torch.device("cuda"), "bfloat16")
    arena = StateArena(model.module.state_layout(), NUM_SLOTS, model.dtype, model.device)
    plain = StreamRoutine(model, arena, max(k.batch for k in keys), max(k.frames for k in keys))
    manager = GraphManager({"exact": plain}, tuple(keys), model.device, Metrics(), max_graph_memory_bytes=None,
                           compiled={"exact": CompiledRoutine(plain, "exact", len(keys))})
    t1 = time.perf_counter()
    manager.capture_startup()
    print(f"startup ({cache}): model {t1 - t0:.1f} s, compile + capture of {len(keys)} buckets "
          f"{time.perf_counter() - t1:.1f} s, pool {manager.pool_bytes / 2**20:.1f} MiB")
    for row in manager.summary():
        print(f"  {row['bucket']:<10s} {row['status']:<9s} compiled={row['compiled']} capture {row['capture_s']:6.2f} s"
              f"  pool +{row['pool_bytes'] / 2**20:7.1f} MiB  {row['reason'][:200]}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if os.environ.get("STARTUP"):
        startup(os.environ["STARTUP"])
        return
    configure_compile_cache(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    batches = env_ints("BATCHES", "1,16,64")
    configure_cuda(False)  # TF32 off, cudnn.benchmark off: the server's defaults
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    model, _, plain, manager = build("bfloat16", batches, compile_=False)
    flops = flops_per_audio_s(model)
    print(f"FLOPs per audio-second {flops / 1e9:.1f} G; ceiling {PEAK_FLOPS / flops:.0f} audio-s/s at "
          f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s (assumed bf16 dense peak)")
    manager.capture_startup()
    print("\n-- plain graphs (bf16)")
    plain_rows = step_table(model, plain, manager, batches, flops)
    for b in env_ints("PROFILE", "16,1") if os.environ.get("EAGER_PROFILE", "1") == "1" else ():
        with torch.inference_mode():
            top_kernels(lambda: plain.forward(b, FRAMES), f"eager b{b}xt{FRAMES}")
    del manager
    torch.cuda.empty_cache()
    model, _, plain, manager = build("bfloat16", batches, compile_=True)
    manager.capture_startup()
    compiled = manager.compiled["exact"]
    print("\n-- compiled graphs (bf16); compile s per shape:",
          {f"b{b}xt{t}" + (f"/{k}" if k > 1 else ""): round(s, 1) for (b, t, k), s in compiled.compile_s.items()})
    compiled_rows = step_table(model, plain, manager, batches, flops)
    print(f"\n-- step device time, ratios in this run (bf16, {FRAMES} frames):")
    for b in batches:
        (p_ms, e_ms, *_), (c_ms, *_) = plain_rows[b], compiled_rows[b]
        print(f"  b{b:<3d} compiled/plain graph {c_ms / p_ms:.3f}  compiled/eager {c_ms / e_ms:.3f}  "
              f"plain graph/eager {p_ms / e_ms:.3f}")
    for b in env_ints("PROFILE", "16,1"):
        with torch.inference_mode():
            top_kernels(lambda: compiled.forward(b, FRAMES), f"compiled b{b}xt{FRAMES} (uncaptured)")
    del manager
    torch.cuda.empty_cache()
    if os.environ.get("FP32", "1") == "1":
        fp32_check()
    if os.environ.get("SNR", "1") == "1":
        configure_cuda(False)
        ref = audio_of("float32", False, 4)
        for label, compile_ in (("plain graph", False), ("compiled graph", True)):
            print(f"bf16 SNR vs fp32, {label}: {snr_db(ref, audio_of('bfloat16', compile_, 4)):.2f} dB")


if __name__ == "__main__":
    main()
