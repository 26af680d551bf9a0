"""The graph-free exact step the profile commands run (``profile.py``, ``roofline.py``): its inputs staged, its sizes
checked, and the form each conv and GEMM of the step chose."""

from __future__ import annotations

import torch

from .inputs import InputContract, synthetic_inputs


def staged_step(model, batch: int, num_frames: int):
    """The graph-free exact step of ``model`` at ``batch`` x ``num_frames``, its inputs staged: a callable that runs
    the routine's forward (what a CUDA graph captures), each call one more chunk of every row's stream."""
    from code2wav.sidecar.engine import DecodeItem
    from code2wav.sidecar.graphs.routine import StreamRoutine
    from code2wav.sidecar.state_store import StateArena

    arena = StateArena(model.module.state_layout(), batch, model.dtype, model.device)
    routine = StreamRoutine(model, arena, batch, num_frames)
    contract = InputContract.of(model)
    items = [DecodeItem(codes=synthetic_inputs(contract, num_frames, seed=2 + b), slot=arena.allocate(),  # [C, T]
                        skip_frames=0) for b in range(batch)]
    routine.copy_in(batch, num_frames, items)
    return lambda: routine.forward(batch, num_frames)  # [B, T * U]


def check_sizes(batch: int, num_frames: int, steps: int, warmup: int) -> None:
    if batch < 1 or num_frames < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"--batch, --frames and --steps must be >= 1 and --warmup >= 0 (got {batch}, {num_frames}, "
                         f"{steps}, {warmup})")


def chosen_forms(module: torch.nn.Module) -> list[dict]:
    """The form each conv and GEMM of the step chose (their ``KernelChoice``), with every form's time."""
    from code2wav.sidecar.kernels.conv_choice import choices_under

    found = []
    for where, choice in choices_under(module):
        for key, chosen in getattr(choice, "decisions", {}).items():
            timings = getattr(choice, "timings_ms", {}).get(key, {})
            found.append({"module": where, "kind": type(choice).__name__, "shape": repr(key), "chosen": chosen,
                          "timings_us": {f: round(ms * 1e3, 1) for f, ms in sorted(timings.items(),
                                                                                 key=lambda kv: kv[1])}})
    return found
