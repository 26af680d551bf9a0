"""How many kernels one exact step launches, by op (developer tool; CPU or GPU).

At batch 1 the exact step is bound by kernel launches, not bytes (docs/performance.md), so the count of ops that
launch a kernel is the first thing to cut. This runs one step of ``MODEL`` (``StreamRoutine.forward``: the state
gather, ``forward_stream``, the state scatter: what a CUDA graph captures) at ``BATCH`` x ``FRAMES`` under a
``TorchDispatchMode`` and counts every dispatched op that is not a view (nor a ``to`` / ``contiguous`` that returns
its input), per op and for the whole step, then for the Qwen3-TTS transformer alone.

On the CPU the Snake modules are forced onto their fused path (``runs_fused``; its ops then run their torch
expressions, as ``tests/test_fused_paths_cpu.py`` does), so the op sequence is the one the GPU step runs. An op is
counted as one kernel: on CUDA a few launch more than one (an ``F.rms_norm`` without the fused kernel, a
``scaled_dot_product_attention`` that falls back to its math form); ``torch.profiler`` on the GPU gives the exact
launches.

On a CUDA device it then prints the form each GEMM chose (cuBLAS or the float32 3xTF32 kernel, with every form's
time), runs the step under ``torch.profiler`` and prints the GPU kernels one step actually launches (count, summed
device time, the top kernels), to check the op count above against real launches.

``python loadgen/probes/kernel_count.py`` (``MODEL=default BATCH=1 FRAMES=1 DTYPE=bfloat16 DEVICE=cpu``;
``MODEL=voxcpm2-default FRAMES=4`` for the VoxCPM2 family).
"""

from __future__ import annotations

import collections
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.models import load_model
from code2wav.sidecar.models.qwen3_tts.blocks import SnakeBeta
from code2wav.sidecar.models.qwen3_tts.streaming import StreamCtx
from code2wav.sidecar.models.voxcpm2_audiovae.blocks import Snake
from code2wav.sidecar.state_store import StateArena

MODEL = os.environ.get("MODEL", "default")
BATCH = int(os.environ.get("BATCH", "1"))
FRAMES = int(os.environ.get("FRAMES", "1"))
DTYPE = os.environ.get("DTYPE", "bfloat16")
DEVICE = torch.device(os.environ.get("DEVICE", "cpu"))

VIEWS = frozenset({"alias", "as_strided", "chunk", "detach", "expand", "flatten", "narrow", "permute", "reshape",
                   "select", "slice", "split", "squeeze", "t", "transpose", "unbind", "unsqueeze", "view", "view_as",
                   "_unsafe_view"})


class KernelOps(TorchDispatchMode):
    """Counts the dispatched ops that launch a kernel (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        returns_input = name in ("to", "contiguous", "reshape") and args and out is args[0]
        if name not in VIEWS and not returns_input:
            self.counts[name] += 1
        return out


def _report(title: str, counts: collections.Counter[str]) -> None:
    print(f"{title}: {sum(counts.values())} kernel ops")
    print("  " + ", ".join(f"{name} {n}" for name, n in counts.most_common()))


def _profile(routine: StreamRoutine) -> None:
    """The kernels one step launches on the GPU (torch.profiler), averaged over 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    num_steps = 5
    for _ in range(3):
        routine.forward(BATCH, FRAMES)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            routine.forward(BATCH, FRAMES)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: collections.Counter[str] = collections.Counter()
    time_us: collections.Counter[str] = collections.Counter()
    for e in kernels:
        by_name[e.name] += 1
        time_us[e.name] += e.device_time
    total_us = sum(time_us.values()) / num_steps
    print(f"GPU (torch.profiler): {len(kernels) / num_steps:.0f} kernels per step, {total_us:.0f} us summed device time")
    for name, us in time_us.most_common(12):
        print(f"  {us / num_steps:8.1f} us  {by_name[name] / num_steps:5.1f}x  {name[:110]}")


def _choices(module: torch.nn.Module) -> None:
    """The form each GEMM of the step chose (``kernels/matmul_choice.py``'s ``MatmulChoice``), with every form's
    time."""
    from code2wav.sidecar.kernels.conv_choice import held_choices
    from code2wav.sidecar.kernels.matmul_choice import MatmulChoice

    for name, sub in module.named_modules():
        for choice in held_choices(sub):
            if not isinstance(choice, MatmulChoice):
                continue
            for key, timings in choice.timings_ms.items():
                shape = f"{key[0][0]}x{key[0][1]} @ {key[0][1]}x{key[1]}"
                forms = " ".join(f"{f} {ms * 1e3:.0f}" for f, ms in sorted(timings.items(), key=lambda kv: kv[1]))
                print(f"  gemm {name} {shape}: {choice.decisions[key]} (us: {forms})")


def main() -> None:
    if DEVICE.type == "cpu":  # the fused path's op sequence (its ops run their torch expressions here)
        for activation in (SnakeBeta, Snake):
            activation.runs_fused = lambda self, x: not torch.compiler.is_compiling()
    model = load_model(MODEL, DEVICE, DTYPE)
    if DEVICE.type == "cpu":  # the blocks' own kernel ops (their CPU implementations here), as switched on the GPU
        for sub in model.module.modules():
            if hasattr(sub, "kernels_on"):
                sub.kernels_on = True
    arena = StateArena(model.module.state_layout(), BATCH, model.dtype, model.device)
    routine = StreamRoutine(model, arena, BATCH, FRAMES)
    routine.prime(BATCH, FRAMES)
    with torch.inference_mode():
        routine.forward(BATCH, FRAMES)  # first-call work (conv choices, stacked weights) out of the count
        with KernelOps() as step:
            routine.forward(BATCH, FRAMES)
        _report(f"{MODEL}, {DTYPE}, one exact step, batch {BATCH} x {FRAMES} frames", step.counts)
        if DEVICE.type == "cuda":
            _choices(model.module)
            _profile(routine)
        pre = getattr(getattr(model.module, "decoder", None), "pre_transformer", None)
        if pre is None:
            return
        x = torch.zeros((BATCH, FRAMES, pre.input_proj.in_features), dtype=model.dtype, device=DEVICE)
        state = model.module.zero_state(BATCH)
        starts = torch.zeros(BATCH, dtype=torch.long, device=DEVICE)
        lengths = torch.full((BATCH,), FRAMES, dtype=torch.long, device=DEVICE)
        with KernelOps() as transformer:
            pre(x, starts, lengths, StreamCtx(state))
        _report("  of which the transformer (pre_transformer)", transformer.counts)


if __name__ == "__main__":
    main()
