"""Which form each conv of the Qwen3-TTS step runs in, and what every form measured (GPU box, developer tool).

Runs eager exact steps of the default model (``DTYPE``, fused kernels on) at each of ``BATCHES`` x ``FRAMES``, so
every dense conv's ``ConvChoice`` (``sidecar/kernels/conv_choice.py``) measures its forms at that shape, then prints
per conv and batch the device time of every form (cuDNN, polyphase, the GEMM kernel's tile configs) and the pick,
with sums per batch: the chosen forms against cuDNN alone. Then the device time of one eager step per batch.

``python loadgen/probes/conv_forms.py`` (``BATCHES=1,16,64 FRAMES=25``; ``DEVICE=cpu DTYPE=float32`` is a dry run:
nothing is measured on the CPU).
"""

from __future__ import annotations

import os

import torch

from code2wav.loadgen.inputs import InputContract, synthetic_inputs
from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.kernels.conv_choice import ConvChoice
from code2wav.sidecar.models import load_model
from code2wav.sidecar.state_store import StateArena

BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,16,64").split(",")]
FRAMES = int(os.environ.get("FRAMES", "25"))
DEVICE = torch.device(os.environ.get("DEVICE", "cuda"))
DTYPE = os.environ.get("DTYPE", "bfloat16")


def _step_ms(engine: Engine, items: list) -> float:
    if DEVICE.type != "cuda":
        engine.decode(items)
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    engine.decode(items)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    model = load_model("default", DEVICE, DTYPE)
    arena = StateArena(model.module.state_layout(), max(BATCHES), model.dtype, model.device)
    engine = Engine(model, arena)
    codes = synthetic_inputs(InputContract.of(model), FRAMES, seed=2)  # [Q, T]
    slots = [arena.allocate() for _ in range(max(BATCHES))]
    choices = {name: m.choice for name, m in model.module.named_modules()
               if isinstance(getattr(m, "choice", None), ConvChoice)}
    for batch in BATCHES:
        items = [DecodeItem(codes=codes, slot=slot, skip_frames=0) for slot in slots[:batch]]
        engine.decode(items)  # measures every conv's forms at this batch
        step_ms = min(_step_ms(engine, items) for _ in range(5))
        print(f"\nbatch {batch} x {FRAMES} frames, {DTYPE}: eager step {step_ms:.3f} ms (min of 5)")
        chosen_sum = cudnn_sum = 0.0
        for name, choice in choices.items():
            for key, timings in choice.timings_ms.items():
                if key[0] != batch:
                    continue
                pick = choice.decisions[key]
                chosen_sum += timings[pick]
                cudnn_sum += timings["cudnn"]
                forms = "  ".join(f"{form} {ms:7.3f}" for form, ms in timings.items())
                print(f"  {name:38s} {str(tuple(key[:3])):20s} -> {pick:9s} | {forms}")
        print(f"  sum over the convs: chosen {chosen_sum:.3f} ms, cuDNN alone {cudnn_sum:.3f} ms")


if __name__ == "__main__":
    main()
