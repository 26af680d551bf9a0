"""The step ``graphs.compile`` compiles traces whole after an eager warm-up, for both families, on the CPU.

``graphs/compiled.py`` compiles ``StreamRoutine.forward`` (state gather, ``forward_stream``, state scatter) per
bucket with ``fullgraph=True``, after the manager's eager warm-up has run it: by then every kept derived tensor
(``kernels/derived.py``: weight copies checked by data pointer, which Dynamo cannot trace) exists, and a block that
reads one under ``torch.compile`` breaks the graph, so every compiled bucket would fall back to the plain step.
The CUDA test (``tests/test_compiled_cuda.py``) compiles with Inductor on the GPU; this one traces the same way with
the ``aot_eager`` backend (no code generation) in seconds on the CPU, and checks the compiled step's audio and
committed state against the eager step's, from a state left by an earlier chunk, a row right-padded.
"""

from __future__ import annotations

import pytest
import torch

from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.models import load_model
from code2wav.sidecar.state_store import StateArena
from conftest import TINY, VOXCPM2_TINY

BATCH, FRAMES = 2, 4


def _fill(routine: StreamRoutine, model, seed: int) -> None:
    """Random inputs on the static buffers: rows on slots 0 and 1, the second right-padded by one frame."""
    gen = torch.Generator().manual_seed(seed)
    spec = model.input
    shape = (BATCH, spec.channels, FRAMES)
    if spec.kind == "codes":
        inputs = torch.randint(0, spec.high, shape, generator=gen)
    else:
        inputs = torch.randn(shape, generator=gen)
    routine.inputs[:BATCH, :, :FRAMES].copy_(inputs)
    routine.num_frames[:BATCH].copy_(torch.tensor([FRAMES, FRAMES - 1]))
    routine.slots[:BATCH].copy_(torch.tensor([0, 1]))


@pytest.mark.parametrize("folder", [TINY, VOXCPM2_TINY], ids=["qwen3_tts", "voxcpm2_audiovae"])
def test_the_compiled_step_traces_whole_after_warm_up_and_equals_the_eager_step(folder):
    model = load_model(str(folder), torch.device("cpu"), "float32")
    arena = StateArena(model.module.state_layout(), BATCH, model.dtype, model.device)
    routine = StreamRoutine(model, arena, BATCH, FRAMES)
    with torch.inference_mode():
        _fill(routine, model, seed=0)
        routine.forward(BATCH, FRAMES)  # the warm-up, which also leaves the rows a state to carry
        flat, positions = arena.flat.clone(), arena.positions.clone()
        _fill(routine, model, seed=1)
        eager = routine.forward(BATCH, FRAMES).clone()  # [B, T * U]
        eager_state = arena.flat.clone()
        arena.flat.copy_(flat)
        arena.positions.copy_(positions)
        compiled = torch.compile(routine.forward, backend="aot_eager", fullgraph=True, dynamic=False)
        got = compiled(BATCH, FRAMES)  # [B, T * U]
    assert (got - eager).abs().max().item() <= 1e-5 * max(1.0, eager.abs().max().item())
    assert (arena.flat - eager_state).abs().max().item() <= 1e-5 * max(1.0, eager_state.abs().max().item())
