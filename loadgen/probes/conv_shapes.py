"""Which convolutions of the Qwen3-TTS step are slow, and what the alternatives cost (GPU box, developer tool).

1. One eager bf16 exact step (default model, ``BATCH`` x ``FRAMES``, fused kernels on) under torch.profiler with
   shapes recorded: the top operators grouped by input shape, and the top device kernels.
2. Every conv of the decoder at the shape that step gives it (forward hooks), at each of ``BATCHES``, timed alone
   (CUDA events, median of ``ITERS``) as the step runs it (cuDNN's heuristics) against cuDNN's benchmark mode, and
   for dilated convs the polyphase form (one undilated conv over the phases), for 1x1 convs a batched matmul with the
   residual add in its epilogue (``baddbmm``). Summed per layer kind. (A channels-last input was slower for every
   conv at batch 16: dropped.)
3. The last layer (Snake + conv to one channel): ``snake_cat`` + cuDNN against ``code2wav::snake_conv_out``.

``python loadgen/probes/conv_shapes.py`` (``BATCH=16 FRAMES=25 ITERS=20 BATCHES=1,16,64``; ``DEVICE=cpu
DTYPE=float32`` is a dry run).
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict

import torch
from torch import nn

from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.kernels.dilated import polyphase_conv
from code2wav.sidecar.models import load_model
from code2wav.sidecar.state_store import StateArena
from code2wav.loadgen.inputs import InputContract, synthetic_inputs

BATCH = int(os.environ.get("BATCH", "16"))
FRAMES = int(os.environ.get("FRAMES", "25"))
ITERS = int(os.environ.get("ITERS", "20"))
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,16,64").split(",")]
DEVICE = torch.device(os.environ.get("DEVICE", "cuda"))
DTYPE = os.environ.get("DTYPE", "bfloat16")


def _time_ms(fn) -> float:
    for _ in range(3):
        fn()
    if DEVICE.type != "cuda":
        return float("nan")
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    model = load_model("default", DEVICE, DTYPE)
    arena = StateArena(model.module.state_layout(), BATCH, model.dtype, model.device)
    engine = Engine(model, arena)
    codes = synthetic_inputs(InputContract.of(model), FRAMES, seed=2)  # [Q, T]
    items = [DecodeItem(codes=codes, slot=arena.allocate(), skip_frames=0) for _ in range(BATCH)]
    shapes: dict[str, tuple[nn.Module, torch.Size]] = {}

    def record(name: str, conv: nn.Module | None = None):
        def hook(mod, args, out) -> None:  # returns None: the output stays
            shapes.setdefault(name, (conv or mod, args[0].shape))
        return hook

    def record_choice(name: str, block: nn.Module):
        def hook(mod, args, out) -> None:  # the block's input [B, C, T]; its conv sees [B, C, P + T]
            batch, channels, num_cols = args[0].shape
            shapes.setdefault(name, (block.conv, torch.Size((batch, channels, num_cols + block.num_state_cols))))
        return hook

    def register() -> list:
        hooks = [m.register_forward_hook(record(name))
                 for name, m in model.module.named_modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
        # a conv with a ConvChoice runs through it (F.conv1d, not the module's __call__): recorded from its block
        hooks += [m.register_forward_hook(record_choice(f"{name}.conv", m))
                  for name, m in model.module.named_modules() if getattr(m, "choice", None) is not None]
        # a residual unit's 1x1 conv runs as a baddbmm, not as its module: recorded from the unit's input [B, C, T]
        return hooks + [m.register_forward_hook(record(f"{name}.conv2.conv", m.conv2.conv))
                        for name, m in model.module.named_modules() if type(m).__name__ == "ResidualUnit"]

    hooks = register()
    engine.decode(items)
    for h in hooks:
        h.remove()
    engine.decode(items)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        engine.decode(items)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    sort_by = "cuda_time_total" if DEVICE.type == "cuda" else "cpu_time_total"
    print(f"step b{BATCH}xt{FRAMES} {DTYPE}: operators by input shape")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=25, max_name_column_width=40,
                                                             max_shapes_column_width=70))
    print("device kernels")
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"{e.self_device_time_total / 1e3:9.3f} ms {e.count:5d}x  {e.key[:110]}")

    model.family.use_fused_kernels(model.module, False)  # the last layer's conv runs as a module again
    hooks = register()
    engine.decode(items[:1])
    for h in hooks:
        h.remove()
    model.family.use_fused_kernels(model.module, True)
    with torch.no_grad():
        for batch in BATCHES:
            _convs_alone(shapes, batch)
            _last_layer(model, shapes, batch)


def _convs_alone(shapes, batch: int) -> None:
    print(f"\nconvs alone at batch {batch} (the step's shapes, median of {ITERS}, ms): cudnn heuristics | cudnn "
          f"benchmark | dilated as polyphase | 1x1 as baddbmm with the residual")
    totals = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for name, (mod, in_shape) in shapes.items():
        if mod.out_channels == 1:
            continue  # the last layer: below
        x = torch.randn((batch, *in_shape[1:]), device=DEVICE, dtype=mod.weight.dtype)  # [B, C, T]
        plain = _time_ms(lambda: mod(x))
        torch.backends.cudnn.benchmark = True
        bench = _time_ms(lambda: mod(x))
        torch.backends.cudnn.benchmark = False
        poly = mm = float("nan")
        if isinstance(mod, nn.Conv1d) and mod.dilation[0] > 1:
            ref = mod(x)
            got = polyphase_conv(x, mod.weight, mod.bias, mod.dilation[0], mod.groups)
            assert got.shape == ref.shape and (got.float() - ref.float()).abs().max().item() < 0.05 * max(
                1.0, ref.abs().max().item()), name
            poly = _time_ms(lambda: polyphase_conv(x, mod.weight, mod.bias, mod.dilation[0], mod.groups))
        if isinstance(mod, nn.Conv1d) and mod.kernel_size[0] == 1 and mod.groups == 1:
            w = mod.weight[:, :, 0].expand(batch, -1, -1)  # [B, C_out, C_in]
            res = torch.randn(batch, mod.out_channels, in_shape[2], device=DEVICE, dtype=x.dtype)
            mm = _time_ms(lambda: torch.baddbmm(res, w, x))
        kind = f"{type(mod).__name__} k{mod.kernel_size[0]} d{mod.dilation[0]}"
        print(f"{plain:8.3f} {bench:8.3f} {poly:8.3f} {mm:8.3f}  {name} {mod.in_channels}->{mod.out_channels} "
              f"in {(batch, *in_shape[1:])}")
        for i, v in enumerate((plain, bench, poly, mm)):
            totals[kind][i] += v if v == v else 0.0
    print(f"per kind at batch {batch} (sum, ms): heuristics | benchmark | polyphase | baddbmm")
    for kind, (a, b, c, e) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"{a:8.3f} {b:8.3f} {c:8.3f} {e:8.3f}  {kind}")


def _last_layer(model, shapes, batch: int) -> None:
    out_conv = next(m for m, _ in shapes.values() if m.out_channels == 1)
    in_shape = next(s for m, s in shapes.values() if m is out_conv)
    act = [m for m in model.module.modules() if hasattr(m, "runs_fused")][-1]  # the last Snake, before the conv
    num_state_cols = out_conv.kernel_size[0] - 1
    x = torch.randn((batch, in_shape[1], in_shape[2] - num_state_cols), device=DEVICE, dtype=out_conv.weight.dtype)
    state = torch.randn((batch, in_shape[1], num_state_cols), device=DEVICE, dtype=x.dtype)
    lengths = torch.full((batch,), x.shape[2], device=DEVICE)
    alpha, beta = act.alpha.view(-1), getattr(act, "beta", act.alpha).view(-1)
    log_params = hasattr(act, "beta")

    def old():
        cat, _ = torch.ops.code2wav.snake_cat(x, state, alpha, beta, lengths, log_params)
        return out_conv(cat)

    new = _time_ms(lambda: torch.ops.code2wav.snake_conv_out(x, state, alpha, beta, lengths, log_params,
                                                               out_conv.weight, out_conv.bias))
    print(f"last layer at batch {batch}, x {tuple(x.shape)}: snake_cat + cudnn conv {_time_ms(old):.3f} ms, "
          f"snake_conv_out {new:.3f} ms")


if __name__ == "__main__":
    main()
