"""The fused-kernel paths of the streaming kit's blocks and both families, run on the CPU with the ops' own CPU
implementations.

On CUDA the Snakes (the kit's ``StreamActivation``s) hand their work to the ``code2wav::*`` ops
(``sidecar/kernels/``), and the blocks around them change shape: conv biases move into the next kernel
(``in_bias``), a residual unit's input is written over (``baddbmm(out=x)``; the units' 1x1 biases stay pending for
the next kernel, ``pending.run_chain``: VoxCPM2 folds a block's into the next ``ScaleBias`` table), a depthwise conv
runs with the Snake after it (``depthwise_snake``, ``then_act``), a kernel-2s transposed conv over the frame pairs
of ``[prev, x]``; and the blocks' own ops (``kernels_on``: every depthwise conv, a conv's state join with no Snake
before it, the transformer's rotary, norm and gate ops) replace torch ops. The ops' CPU implementations are their
torch expressions, so forcing ``runs_fused`` on CPU tensors runs exactly that bookkeeping here: each kit block's
fused path equals its torch path, and the goldens must still stream within 1e-5, in uneven chunks, with
right-padded rows. (The kernels themselves are compared with these expressions in ``test_kernels.py``, under
Triton's interpreter and on the GPU.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from code2wav.sidecar.models import load_model
from code2wav.sidecar.models.streaming import (CausalConv, CausalTransConv, StreamActivation, StreamContext,
                                               assign_state_keys, zero_state)
from conftest import TINY, VOXCPM2_TINY

TOL = 1e-5


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while active (to check which ops a path ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def num_depthwise(model) -> int:
    """The kit's depthwise convs in a model (Qwen3-TTS's ConvNeXt stages; VoxCPM2's first layer and residual units)."""
    return sum(isinstance(m, CausalConv) and m.depthwise for m in model.module.modules())


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
    assert {"code2wav.snake_cat", "code2wav.snake_pairs", "code2wav.snake_conv_out", "code2wav.depthwise_snake",
            "code2wav.state_cat", "code2wav.rope_kv_cache", "code2wav.window_inputs", "code2wav.add_rms_norm",
            "code2wav.silu_mul"} <= ops.names
    assert "aten.gather" not in ops.names  # every state tail came from a kernel op
    assert "aten.add_" not in ops.names  # the residual units' bias adds went into the kernels
    steps = max(len(p) for p in plans)  # forwards taken: each batches the next chunk of every unfinished row
    assert ops.counts["code2wav.depthwise_snake"] == steps * num_depthwise(model)  # every depthwise conv, every step
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
    # every depthwise conv (the first layer's, on the latents, too), every step
    assert ops.counts["code2wav.depthwise_snake"] == len(chunks) * num_depthwise(model)
    # no pass of the model's own adds a bias to the stream (the ops' CPU expressions are not seen here); that the
    # pending biases are each added once is what the golden comparison below checks
    assert "aten.add_" not in ops.names
    assert (torch.cat(outs[0]) - full[0]).abs().max().item() <= TOL
    row1 = torch.cat(outs[1])  # [starts[1] * U]
    assert row1.shape[0] == starts[1] * spf
    assert (row1 - full[1, :row1.shape[0]]).abs().max().item() <= TOL


def _activation(kind: str, channels: int, seed: int) -> StreamActivation:
    """Qwen3-TTS's SnakeBeta (``alpha``, ``beta`` as logs) or VoxCPM2's Snake (``alpha`` as stored), seeded, float64."""
    from code2wav.sidecar.models.qwen3_tts.blocks import SnakeBeta
    from code2wav.sidecar.models.voxcpm2_audiovae.blocks import Snake

    gen = torch.Generator().manual_seed(seed)
    act = (SnakeBeta if kind == "SnakeBeta" else Snake)(channels).double()
    with torch.no_grad():
        for p in act.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            if kind == "Snake":
                p.exp_()  # alpha used as stored: positive, as trained ones are
    return act


KIT_CASES = {  # a kit block and what its fused path gets: the biases pending on x, a Snake after it, its bias later
    "dense-then-act": (lambda: CausalConv(6, 6, 7, dilation=3), dict(in_bias=True, then_act=True)),
    "dense-bias-later": (lambda: CausalConv(6, 5, 3), dict(in_bias=True, bias_later=True)),
    "depthwise-then-act": (lambda: CausalConv(6, 6, 7, dilation=3, groups=6), dict(in_bias=True, then_act=True)),
    "one-output": (lambda: CausalConv(6, 1, 7), dict(in_bias=True)),
    "transposed-2s": (lambda: CausalTransConv(6, 4, 6, 3), dict(in_bias=True, bias_later=True)),
}
KIT_OPS = {"dense-then-act": "code2wav.snake_cat", "dense-bias-later": "code2wav.snake_cat",
           "depthwise-then-act": "code2wav.depthwise_snake", "one-output": "code2wav.snake_conv_out",
           "transposed-2s": "code2wav.snake_pairs"}


def _stream_block(block, act, then_act, in_bias, bias_later: bool, x: Tensor, lengths: list[Tensor]):
    """``x`` ``[2, C, 9]`` in chunks of 5 and 4 columns, row 1 one column short each time (loud padding), the state
    carried: each chunk's output (with the bias added back where it was left out) and the last state."""
    state = zero_state(assign_state_keys(nn.ModuleDict({"b": block})), 2, x.dtype, x.device)
    outs, start = [], 0
    for n, chunk_lengths in zip((5, 4), lengths):
        chunk = x[:, :, start:start + n].clone()
        chunk[1, :, chunk_lengths[1]:] = 50.0
        ctx = StreamContext(state)
        kwargs = dict(act=act, in_bias=in_bias, bias_later=bias_later)
        if then_act is not None:  # (a transposed conv takes none)
            kwargs["then_act"] = then_act
        y, _ = block(chunk, chunk_lengths, ctx, **kwargs)
        if bias_later:
            y = y + block.conv.bias[None, :, None]
        outs.append(y)
        state = ctx.state_out
        start += n
    return outs, state


@pytest.mark.parametrize("kind", ["SnakeBeta", "Snake"])
@pytest.mark.parametrize("case", list(KIT_CASES))
def test_each_kit_blocks_fused_path_equals_its_torch_path(monkeypatch, kind, case):
    """The kit's fused bookkeeping (``in_bias``, ``then_act``, ``bias_later``, the state tail the op writes) with the
    ops' CPU implementations, against the same block on its torch path (the pending biases added to ``x`` first,
    the bias never left out), for both families' activations: outputs of two chunks with a right-padded row, and
    the state carried (float64)."""
    make, flags = KIT_CASES[case]
    block = make().double()
    gen = torch.Generator().manual_seed(len(case))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    act = _activation(kind, 6, 1)
    then_act = _activation(kind, block.conv.out_channels, 2) if flags.get("then_act") else None
    in_bias = torch.randn(6, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 6, 9, generator=gen, dtype=torch.float64)
    lengths = [torch.tensor([5, 4]), torch.tensor([4, 3])]
    with torch.inference_mode():
        plain_outs, plain_state = _stream_block(block, act, then_act, None, False,
                                                x + in_bias[None, :, None], lengths)
        with monkeypatch.context() as m:
            m.setattr(StreamActivation, "runs_fused", lambda self, x: True)
            m.setattr(CausalConv, "runs_depthwise_kernel", lambda self, x: self.depthwise and self.kernels_on)
            block.kernels_on = True
            with OpNames() as ops:
                fused_outs, fused_state = _stream_block(block, act, then_act, in_bias, flags.get("bias_later", False),
                                                        x, lengths)
    assert KIT_OPS[case] in ops.names and "aten.gather" not in ops.names
    for plain, fused, n in zip(plain_outs, fused_outs, lengths):
        scale = 3 if case == "transposed-2s" else 1  # output columns per input column
        assert fused.shape == plain.shape
        assert (fused[0] - plain[0]).abs().max().item() < 1e-10
        assert (fused[1, :, :int(n[1]) * scale] - plain[1, :, :int(n[1]) * scale]).abs().max().item() < 1e-10
    assert set(fused_state) == set(plain_state)
    assert all((fused_state[k] - plain_state[k]).abs().max().item() < 1e-10 for k in plain_state)
