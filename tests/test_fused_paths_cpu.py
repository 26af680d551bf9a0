"""The fused-kernel paths of both families' blocks, run on the CPU with the ops' own CPU implementations.

On CUDA the Snake modules hand their work to the ``code2wav::*`` ops (``sidecar/kernels/``), and the blocks around
them change shape: conv biases move into the next kernel (``in_bias``), a residual unit's input is written over
(``baddbmm(out=x)``; the units' 1x1 biases stay pending for the next kernel, ``pending.run_chain``: VoxCPM2 folds
a block's into the next ``ScaleBias`` table), VoxCPM2's depthwise conv runs with its second Snake
(``depthwise_snake``) and its transposed conv over ``[prev, x]``; and the blocks' own ops (``kernels_on``: a conv's
state join with no Snake before it, the transformer's rotary, norm and gate ops) replace torch ops. The ops' CPU implementations are their torch
expressions, so forcing ``runs_fused`` on CPU tensors runs exactly that bookkeeping here: the goldens must still
stream within 1e-5, in uneven chunks, with right-padded rows. (The kernels themselves are compared with these
expressions in ``test_kernels.py``, under Triton's interpreter and on the GPU.)
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from code2wav.sidecar.models import load_model
from code2wav.sidecar.models.streaming import CausalConv, StreamActivation
from conftest import TINY, VOXCPM2_TINY

TOL = 1e-5


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while active (to check which ops a path ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def forced_fused(monkeypatch):
    """Both families' Snakes (the kit's ``StreamActivation``s) run their fused paths on CPU tensors (``runs_fused``
    normally needs CUDA), and so do the kit's depthwise convs (both families': ``depthwise_snake``)."""
    monkeypatch.setattr(StreamActivation, "runs_fused", lambda self, x: not torch.compiler.is_compiling())
    monkeypatch.setattr(CausalConv, "runs_depthwise_kernel",
                        lambda self, x: self.depthwise and self.kernels_on and not torch.compiler.is_compiling())


def kernels_on(model) -> None:
    """Every block's own kernel ops on, as ``conv_choice.switch_kernels`` sets them on CUDA (here: their CPU forms)."""
    for sub in model.module.modules():
        if hasattr(sub, "kernels_on"):
            sub.kernels_on = True


def test_qwen3_fused_path_streams_the_golden(forced_fused, golden_cases):
    from test_exact_streaming import make_engine, stream_interleaved

    model = load_model(str(TINY), torch.device("cpu"), "float32")
    kernels_on(model)
    engine = make_engine(model)
    full = golden_cases["full"][:, 0]  # [2, T * U]
    num_frames = golden_cases["codes"].shape[2]
    plans = [[1, 16, num_frames - 17], [5, 1, 9, num_frames - 15]]  # rows at different positions share steps
    with torch.inference_mode(), OpNames() as ops:
        out_a, out_b = stream_interleaved(engine, golden_cases["codes"], plans)
    assert {"code2wav.snake_cat", "code2wav.snake_pairs", "code2wav.snake_conv_out", "code2wav.depthwise_snake", "code2wav.state_cat", "code2wav.rope_kv_cache",
            "code2wav.window_inputs", "code2wav.add_rms_norm", "code2wav.silu_mul"} <= ops.names
    assert "aten.gather" not in ops.names  # every state tail came from a kernel op
    assert "aten.add_" not in ops.names  # the residual units' bias adds went into the kernels
    assert (out_a - full[0]).abs().max().item() <= TOL
    assert (out_b - full[1]).abs().max().item() <= TOL


@pytest.mark.parametrize("chunks", [[1, 16, 40], [4, 4, 25, 24]])
def test_voxcpm2_fused_path_streams_the_golden_with_padded_rows(forced_fused, chunks):
    model = load_model(str(VOXCPM2_TINY), torch.device("cpu"), "float32")
    kernels_on(model)
    cases = load_file(str(VOXCPM2_TINY / "cases.safetensors"))
    latents, full = cases["latents"], cases["full"][:, 0]  # [2, D, 57], [2, 57 * U]
    module, spf = model.module, model.module.samples_per_frame
    state = module.zero_state(2)
    outs, starts = [[], []], [0, 0]
    with torch.inference_mode(), OpNames() as ops:
        for n in chunks:
            sizes = [n, n - 1]  # row 1 one frame short each step: right padding that must not reach its state
            batch = torch.full((2, latents.shape[1], n), 7.0)  # [2, D, n], loud padding
            for b in range(2):
                batch[b, :, :sizes[b]] = latents[b, :, starts[b]:starts[b] + sizes[b]]
            wav, state = module.forward_stream(batch, torch.tensor(sizes), state)  # [2, n * U]
            for b in range(2):
                outs[b].append(wav[b, :sizes[b] * spf])
                starts[b] += sizes[b]
    assert {"code2wav.snake_pairs", "code2wav.snake_cat", "code2wav.depthwise_snake",
            "code2wav.snake_conv_out", "code2wav.state_cat"} <= ops.names
    assert "aten.gather" not in ops.names  # every state tail came from a kernel op
    # no pass of the model's own adds a bias to the stream (the ops' CPU expressions are not seen here); that the
    # pending biases are each added once is what the golden comparison below checks
    assert "aten.add_" not in ops.names
    assert (torch.cat(outs[0]) - full[0]).abs().max().item() <= TOL
    row1 = torch.cat(outs[1])  # [starts[1] * U]
    assert row1.shape[0] == starts[1] * spf
    assert (row1 - full[1, :row1.shape[0]]).abs().max().item() <= TOL
