"""Where VoxCPM2's decoder step spends its device time, and what the alternatives to each layer kind cost (issue 23).

Real config (``voxcpm2-default``, seeded random weights), TF32 off (the server's math), on one GPU. For each dtype
(``DTYPES``, default float32,bfloat16):

1. torch.profiler top kernels of one eager exact step at ``SHAPES`` (default ``64x25,1x4``: rows x new frames);
2. per layer kind, at every stage's shapes of the ``64x25`` step, device time of today's formulation and of the
   alternatives (summed over the step, each kind weighted by how often the step runs it):
   - Snake: 5 eager kernels vs one compiled (Inductor/Triton, dynamic shapes: a floor for static) kernel;
   - 1x1 conv: cuDNN ``conv1d`` vs a cuBLAS ``matmul`` ``[Cout, Cin] @ [B, Cin, T]``;
   - depthwise k7 conv: cuDNN ``conv1d(groups=C)`` vs a compiled sum of 7 shifted slices;
   - transposed conv: cuDNN ``conv_transpose1d`` vs one GEMM ``[2s*Cout, Cin] @ [B, Cin, L]`` and an overlap-add;
   - the state ``cat`` in front of every stateful conv;
3. the whole step through ``StreamRoutine`` + ``GraphManager``: plain graph vs compiled graph (``CompiledRoutine``,
   static shapes) at ``WHOLE`` (``dtype:rowsxframes,...``, default fp32 1x4 and 64x25, bf16 64x25), device time per
   replay, audio-s/s, compile s.

4. one dynamic-shape compile (``CompiledRoutine(dynamic=True)``, ``DYNAMIC`` dtype, default float32, empty skips)
   captured at ``DYNAMIC_SHAPES``: compile s per shape and device time per replay.

``EAGER=0`` skips sections 1 and 2. ``BUDGET_S`` (default 330) stops starting new sections once that much wall time has passed (compiles are slow).
Run from the repository root: ``python loadgen/probes/voxcpm2_ops.py``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from compile_profile import device_ms as cuda_ms, make_items, top_kernels  # noqa: E402

from code2wav.sidecar.graphs.compiled import CompiledRoutine  # noqa: E402
from code2wav.sidecar.graphs.manager import GraphManager  # noqa: E402
from code2wav.sidecar.graphs.plan import BucketKey  # noqa: E402
from code2wav.sidecar.graphs.routine import StreamRoutine  # noqa: E402
from code2wav.sidecar.metrics import Metrics  # noqa: E402
from code2wav.sidecar.models import configure_cuda, load_model  # noqa: E402
from code2wav.sidecar.state_store import StateArena  # noqa: E402

MODEL = os.environ.get("MODEL", "voxcpm2-default")  # a tiny model folder and DEVICE=cpu: a dry run of the script
DEVICE = torch.device(os.environ.get("DEVICE", "cuda"))
T0 = time.perf_counter()
BUDGET_S = float(os.environ.get("BUDGET_S", "330"))


def device_ms(fn, iters: int = 20) -> float:
    if DEVICE.type == "cuda":
        return cuda_ms(fn, iters)
    fn()
    t0 = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t0) / 2 * 1e3


def shapes(name: str, default: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in os.environ.get(name, default).split(",") if s]  # type: ignore


def over_budget(section: str) -> bool:
    spent = time.perf_counter() - T0
    if spent > BUDGET_S:
        print(f"\n[skipping {section}: {spent:.0f} s spent, BUDGET_S={BUDGET_S:.0f}]")
        return True
    return False


def snake_eager(x, alpha):
    out = torch.mul(alpha, x).sin_().square_()
    return torch.addcdiv(x, out, alpha + 1e-9, out=out)


def snake_ref(x, alpha):
    return x + torch.sin(alpha * x) ** 2 / (alpha + 1e-9)


def dw_shifted(x, w, bias, dilation: int):
    """Depthwise k7 conv as 7 shifted multiply-adds: ``x`` ``[B, C, P + T]``, ``w`` ``[C, 1, 7]``."""
    num_out = x.shape[2] - 6 * dilation
    y = bias[None, :, None] + w[None, :, 0, 0:1] * x[:, :, 0:num_out]
    for k in range(1, 7):
        y = y + w[None, :, 0, k:k + 1] * x[:, :, k * dilation:k * dilation + num_out]
    return y  # [B, C, T]


def trans_gemm(x, w2, bias, s: int):
    """ConvTranspose1d (kernel 2s, stride s, first L*s samples) as one GEMM and an overlap-add:
    ``w2`` ``[2s*Cout, Cin]`` (rows ``k*Cout + o``), ``x`` ``[B, Cin, L]``."""
    batch, _, num_in = x.shape
    y = torch.matmul(w2, x)  # [B, 2s*Cout, L]
    y = y.view(batch, 2, s, -1, num_in)  # [B, 2, s, Cout, L]
    head, tail = y[:, 0], y[:, 1]  # [B, s, Cout, L] each: own frame, previous frame's share
    tail = F.pad(tail, (1, -1))  # frame t gets frame t-1's tail
    out = (head + tail).permute(0, 2, 3, 1).reshape(batch, -1, num_in * s)  # [B, Cout, L*s]
    return out + bias[None, :, None]


def op_table(model, dtype: torch.dtype, rows: int, frames: int) -> None:
    dec = model.module.decoder
    cfg = model.module.cfg
    dev = DEVICE
    torch._dynamo.config.recompile_limit = 64  # one compile per function (dynamic shapes), a few for the ints
    compiled_snake = torch.compile(snake_ref, dynamic=True)
    compiled_dw = torch.compile(dw_shifted, dynamic=True)
    compiled_trans = torch.compile(trans_gemm, dynamic=True)
    totals: dict[str, list[float]] = {}

    def add(kind: str, ms: list[float], count: int) -> None:
        acc = totals.setdefault(kind, [0.0] * len(ms))
        for i, v in enumerate(ms):
            acc[i] += v * count

    print(f"\n-- per layer kind, {rows}x{frames}, {dtype}: ms per call (today / alternatives), max abs diff")
    num_in = frames
    for i, (cin, cout, s) in enumerate(cfg.block_channels()):
        block = dec.model[2 + i].block
        x = torch.randn(rows, cin, num_in, device=dev, dtype=dtype)
        alpha = block[0].alpha.detach()
        with torch.inference_mode():
            sa = device_ms(lambda: snake_eager(x, alpha))
            sb = device_ms(lambda: compiled_snake(x, alpha))
            add("snake", [sa, sb], 1)
            tc = block[1]
            w, bias = tc.weight.detach(), tc.bias.detach()
            w2 = w.permute(2, 1, 0).reshape(2 * s * cout, cin).contiguous()  # [2s*Cout, Cin]
            ref = F.conv_transpose1d(x, w, bias, stride=s)[:, :, :num_in * s]
            err = (trans_gemm(x, w2, bias, s) - ref).abs().max().item()
            a = device_ms(lambda: F.conv_transpose1d(x, w, bias, stride=s))
            b = device_ms(lambda: trans_gemm(x, w2, bias, s))
            c = device_ms(lambda: compiled_trans(x, w2, bias, s))
            add("transconv", [a, b, c], 1)
            print(f"  stage {i} {cin}->{cout} s{s} L={num_in}: transconv {a:.3f} / gemm {b:.3f} / compiled {c:.3f}"
                  f"  err {err:.1e};  snake({cin}) {sa:.3f} / compiled {sb:.3f}")
            num_out = num_in * s
            y = torch.randn(rows, cout, num_out, device=dev, dtype=dtype)
            a = device_ms(lambda: snake_eager(y, block[2].block[0].alpha.detach()))
            b = device_ms(lambda: compiled_snake(y, block[2].block[0].alpha.detach()))
            add("snake", [a, b], 6)
            for j, dil in enumerate((1, 3, 9)):
                dw = block[2 + j].block[1]
                xp = torch.randn(rows, cout, 6 * dil + num_out, device=dev, dtype=dtype)
                wd, bd = dw.weight.detach(), dw.bias.detach()
                ref = F.conv1d(xp, wd, bd, dilation=dil, groups=cout)
                err = (compiled_dw(xp, wd, bd, dil) - ref).abs().max().item()
                a = device_ms(lambda: F.conv1d(xp, wd, bd, dilation=dil, groups=cout))
                b = device_ms(lambda: compiled_dw(xp, wd, bd, dil))
                c = device_ms(lambda: torch.cat([xp[:, :, :6 * dil], y], dim=2))
                add("depthwise", [a, b], 1)
                add("state cat", [c], 1)
                pw = block[2 + j].block[3]
                wp, bp = pw.weight.detach(), pw.bias.detach()
                w2d = wp[:, :, 0].contiguous()  # [Cout, Cin]
                err2 = (torch.matmul(w2d, y) + bp[:, None] - F.conv1d(y, wp, bp)).abs().max().item()
                d = device_ms(lambda: F.conv1d(y, wp, bp))
                e = device_ms(lambda: torch.addmm(bp[:, None], w2d, y[0]) if rows == 1 else
                              torch.matmul(w2d, y).add_(bp[:, None]))
                add("conv1x1", [d, e], 1)
                add("residual add", [device_ms(lambda: y.add(y))], 1)
                if j == 0:
                    print(f"    {cout} ch T={num_out} d{dil}: depthwise {a:.3f} / compiled {b:.3f} err {err:.1e}; "
                          f"1x1 {d:.3f} / matmul {e:.3f} err {err2:.1e}; cat {c:.3f}")
        num_in = num_out
    print(f"  step totals (ms, {rows}x{frames} shapes): " + "; ".join(
        f"{k} " + " / ".join(f"{v:.2f}" for v in vals) for k, vals in totals.items()))


def whole_step(dtype: str, rows: int, frames: int, compile_: bool) -> None:
    model = load_model(MODEL, DEVICE, dtype)
    arena = StateArena(model.module.state_layout(), rows + 8, model.dtype, model.device)
    plain = StreamRoutine(model, arena, rows, frames)
    key = BucketKey("exact", rows, frames)
    compiled = {"exact": CompiledRoutine(plain, "exact", 2)} if compile_ else None
    manager = GraphManager({"exact": plain}, (key,), model.device, Metrics(), max_graph_memory_bytes=None,
                           compiled=compiled)
    t0 = time.perf_counter()
    manager.capture_startup()
    state = manager.buckets[key]
    plain.copy_in(rows, frames, make_items(model, rows, frames, seed=rows))
    ms = device_ms(state.graph.replay) if state.status == "captured" else float("nan")
    rate = rows * frames * model.samples_per_frame / model.sample_rate_hz / (ms / 1e3)
    label = "compiled" if compile_ else "plain"
    print(f"  {dtype:<8s} {rows}x{frames} {label:<8s} graph {ms:8.3f} ms  {rate:8.0f} audio-s/s  "
          f"capture+compile {time.perf_counter() - t0:5.1f} s  pool {state.pool_bytes / 2**20:7.1f} MiB  "
          f"{state.status} {manager.summary()[0].get('reason', '')[:160]}")
    if compile_ and rows > 1 and dtype == "bfloat16" and DEVICE.type == "cuda" and not over_budget("profile"):
        with torch.inference_mode():
            top_kernels(lambda: manager.compiled["exact"].forward(rows, frames), f"compiled {dtype} {rows}x{frames}")


def dynamic_step(dtype: str, keys: list[tuple[int, int]]) -> None:
    """One ``CompiledRoutine(dynamic=True)`` captured at every shape of ``keys``: compile s per shape (the first
    compiles; the rest should reuse it) and device time per replay."""
    model = load_model(MODEL, DEVICE, dtype)
    max_rows, max_frames = max(r for r, _ in keys), max(f for _, f in keys)
    arena = StateArena(model.module.state_layout(), max_rows + 8, model.dtype, model.device)
    plain = StreamRoutine(model, arena, max_rows, max_frames)
    buckets = tuple(BucketKey("exact", r, f) for r, f in sorted(keys, reverse=True))
    compiled = CompiledRoutine(plain, "exact", len(buckets), dynamic=True)
    manager = GraphManager({"exact": plain}, buckets, model.device, Metrics(), max_graph_memory_bytes=None,
                           compiled={"exact": compiled})
    t0 = time.perf_counter()
    manager.capture_startup()
    print(f"  {dtype} dynamic compile + capture of {len(buckets)} buckets {time.perf_counter() - t0:.1f} s, "
          f"compile s per shape {dict((f'{b}x{t}', round(v, 1)) for (b, t, _), v in compiled.compile_s.items())}")
    for key in buckets:
        state = manager.buckets[key]
        plain.copy_in(key.batch, key.frames, make_items(model, key.batch, key.frames, seed=3))
        ms = device_ms(state.graph.replay) if state.status == "captured" else float("nan")
        rate = key.batch * key.frames * model.samples_per_frame / model.sample_rate_hz / (ms / 1e3)
        print(f"  {dtype:<8s} {key.batch}x{key.frames} dynamic  graph {ms:8.3f} ms  {rate:8.0f} audio-s/s  "
              f"{state.status}")


def main() -> None:
    configure_cuda(False)
    print(torch.cuda.get_device_name() if DEVICE.type == "cuda" else DEVICE, "torch", torch.__version__)
    dtypes = os.environ.get("DTYPES", "float32,bfloat16").split(",")
    for dtype in dtypes if os.environ.get("EAGER", "1") == "1" else ():
        model = load_model(MODEL, DEVICE, dtype)
        arena = StateArena(model.module.state_layout(), 72, model.dtype, model.device)
        plain = StreamRoutine(model, arena, 64, 25)
        for rows, frames in shapes("SHAPES", "64x25,1x4"):
            plain.copy_in(rows, frames, make_items(model, rows, frames, seed=1))
            with torch.inference_mode():
                if DEVICE.type == "cuda":
                    top_kernels(lambda: plain.forward(rows, frames), f"eager {dtype} {rows}x{frames}", n=14)
                else:
                    print(f"eager {rows}x{frames}: {device_ms(lambda: plain.forward(rows, frames)):.2f} ms")
        if not over_budget("op table"):
            op_table(model, model.dtype, *shapes("OP_SHAPE", "64x25")[0])
        del plain, model, arena
        torch.cuda.empty_cache()
    print("\n-- whole step, plain vs compiled graph")
    for spec in os.environ.get("WHOLE", "float32:1x4,float32:64x25,bfloat16:64x25").split(","):
        dtype, shape = spec.split(":")
        rows, frames = (int(v) for v in shape.split("x"))
        for compile_ in (False, True):
            if compile_ and over_budget(f"compile {dtype} {rows}x{frames}"):
                continue
            whole_step(dtype, rows, frames, compile_)
            torch.cuda.empty_cache()
    if os.environ.get("DYNAMIC", "float32") and not over_budget("dynamic compile"):
        print("\n-- one dynamic-shape compile for several buckets")
        dynamic_step(os.environ.get("DYNAMIC", "float32"), shapes("DYNAMIC_SHAPES", "64x25,16x25,1x25,64x4,1x4"))
    print(f"\nprobe wall time {time.perf_counter() - T0:.0f} s")


if __name__ == "__main__":
    main()
