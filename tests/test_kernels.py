"""The fused Snake kernels: Snake + state concatenation (``sidecar/kernels/snake.py``, also of ``x`` plus pending
biases), the last layer, Snake + a conv to one channel (``sidecar/kernels/snake_conv.py``), and a depthwise conv + Snake
(``sidecar/kernels/depthwise.py``).

CPU: the kernel's own code under Triton's interpreter (in a subprocess: ``TRITON_INTERPRET`` must be set before
Triton is imported) against the torch expression, for both parameter forms, with and without state, a strided
input and rows of every length; the op's CPU implementation is that expression.
CUDA: the compiled kernel against the expression, then whole decoders with the kernels on against the same
decoders with torch ops (float32, TF32 off: streamed audio and state within 1e-5; bf16: SNR against float32 not
worse), eager and in CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch

from code2wav.sidecar.kernels import depthwise, snake, snake_conv, transposed
from conftest import interpreted_json

HAS_TRITON = importlib.util.find_spec("triton") is not None

CASES = [  # (log_params, state columns, batch, channels, columns, lengths)
    (True, 0, 2, 3, 37, [37, 5]),
    (True, 1, 3, 5, 2100, [2100, 0, 17]),  # more than two column blocks; a padding row (length 0)
    (True, 6, 2, 4, 9, [9, 1]),
    (False, 18, 2, 3, 1030, [1030, 1024]),  # the tail crosses a block edge
    (False, 6, 1, 2, 1, [1]),  # one column: a first chunk at the frame rate
    (True, 6, 2, 40, 130, [125, 130]),  # row 0's tail ends inside x, row 1's at its end
    (False, 6, 2, 200, 70, [60, 70]),  # several channel tiles (snake.tile_for)
    (False, 54, 2, 70, 200, [3, 200]),  # a dilation-9 state: 7 pieces of the state program (snake.STATE_COLS), the
                                        # last partial; row 0's tail from the state and x; two channel tiles
]


def _inputs(case, device="cpu", dtype=torch.float32, seed=0):
    log_params, num_state_cols, batch, channels, num_cols, lengths = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, num_cols + 7, generator=gen)[:, :, 3:3 + num_cols]  # strided, not contiguous
    state = torch.randn(batch, channels, num_state_cols, generator=gen) if num_state_cols else None
    alpha = torch.randn(channels, generator=gen) * 0.3 + (0.0 if log_params else 1.0)
    beta = torch.randn(channels, generator=gen) * 0.3
    to = dict(device=device, dtype=dtype)
    return (x.to(**to), None if state is None else state.to(**to), alpha.to(**to), beta.to(**to),
            torch.tensor(lengths, device=device), log_params)


PAIRS_CASES = [  # one state frame (a transposed conv's), channels across two tiles of the tiled kernel
    (True, 1, 3, 5, 300, [300, 0, 17]),  # three column tiles; a padding row (length 0: the tail is the state)
    (False, 1, 2, 40, 3, [3, 1]),
    (False, 1, 1, 3, 1, [1]),  # one frame: a first chunk
]


def _in_bias_inputs(case, device="cpu", dtype=torch.float32, seed=0):
    """``_inputs`` plus ``in_bias`` (the biases pending on ``x``, added before the Snake)."""
    args = _inputs(case, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    return (*args, torch.randn(args[0].shape[1], generator=gen).to(device=device, dtype=dtype))


def _channels_last(x):
    """``x`` ``[B, C, T]`` with the same values, its channels contiguous (a transposed conv's GEMM output)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _in_bias_reference(x, state, alpha, beta, lengths, log_params, in_bias):
    """``snake.reference`` of ``x + in_bias`` (the biases pending on ``x``, added before the activation)."""
    return snake.reference(x + in_bias[None, :, None], state, alpha, beta, lengths, log_params)


def _cl_out_interpreted(*args):
    """``snake_cat`` writing ``cat`` channels-last (the tiled kernel's strided store): same values, channels
    contiguous."""
    cat, tail = snake.run_interpreted(*args, channels_last=True)
    assert cat.stride(1) == 1 or cat.shape[1] == 1, cat.stride()
    return cat, tail


def _max_err(got, ref) -> float:
    return max(((g.float() - r.float()).abs().max().item() if r.numel() else 0.0) for g, r in zip(got, ref))


CONV_CASES = [  # (log_params, batch, channels, columns, kernel size, lengths)
    (True, 2, 40, 300, 7, [300, 3]),  # two channel blocks; a short row (its tail mixes state and input)
    (False, 3, 5, 1, 7, [1, 0, 1]),  # one column (a first chunk); a padding row (length 0: the tail is the state)
    (True, 1, 96, 530, 7, [530]),  # the real last layer's width; output blocks past the end
    (False, 2, 3, 4, 3, [2, 4]),
]


def _conv_inputs(case, device="cpu", dtype=torch.float32, seed=0):
    log_params, batch, channels, num_cols, ksize, lengths = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, num_cols + 5, generator=gen)[:, :, 2:2 + num_cols]  # strided
    state = torch.randn(batch, channels, ksize - 1, generator=gen)
    alpha = torch.randn(channels, generator=gen) * 0.3 + (0.0 if log_params else 1.0)
    beta = torch.randn(channels, generator=gen) * 0.3
    weight = torch.randn(1, channels, ksize, generator=gen) / (channels * ksize) ** 0.5
    bias = torch.randn(1, generator=gen)
    to = dict(device=device, dtype=dtype)
    return (x.to(**to), state.to(**to), alpha.to(**to), beta.to(**to), torch.tensor(lengths, device=device),
            log_params, weight.to(**to), bias.to(**to))


def _conv_bias_inputs(case, device="cpu", dtype=torch.float32, seed=0):
    """``_conv_inputs`` plus ``in_bias`` ``[C]`` (biases still pending on ``x``: the activation is of ``x +
    in_bias``)."""
    args = _conv_inputs(case, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    return (*args, torch.randn(args[0].shape[1], generator=gen).to(device=device, dtype=dtype))


DW_CASES = [  # (log_params, batch, channels, output columns, kernel size, dilation, Snake after)
    (False, 2, 3, 37, 7, 1, True),
    (False, 1, 2, 1, 7, 9, True),  # one output column from a 55-column input (a first chunk at dilation 9)
    (True, 2, 4, 2100, 7, 3, True),  # three column blocks
    (False, 3, 5, 40, 3, 2, False),  # the conv alone
    (False, 2, 130, 37, 7, 3, True),  # channels-last: three channel tiles of the tiled kernel, the last partial
]


def _dw_inputs(case, device="cpu", dtype=torch.float32, seed=0):
    log_params, batch, channels, num_cols, ksize, dilation, activate = case
    gen = torch.Generator().manual_seed(seed)
    num_in = num_cols + (ksize - 1) * dilation
    x = torch.randn(batch, channels, num_in + 4, generator=gen)[:, :, 1:1 + num_in]  # strided
    weight = torch.randn(channels, 1, ksize, generator=gen) / ksize ** 0.5
    bias = torch.randn(channels, generator=gen)
    alpha = torch.randn(channels, generator=gen) * 0.3 + (0.0 if log_params else 1.0)
    beta = torch.randn(channels, generator=gen) * 0.3
    to = dict(device=device, dtype=dtype)
    return (x.to(**to), weight.to(**to), bias.to(**to), dilation, alpha.to(**to) if activate else None,
            beta.to(**to) if activate else None, log_params)


def _dw_interpreted(*args):
    return (depthwise.run_interpreted(*args),)


def _dw_reference(*args):
    return (depthwise.reference(*args),)


def _conv_tol(ref, rel: float) -> float:
    return rel * max(1.0, max(t.abs().max().item() for t in ref if t.numel()))


INTERPRETED = """
import json, sys
import torch
from code2wav.sidecar.kernels import {module}
sys.path.insert(0, {tests!r})
from test_kernels import {cases}, {inputs}, _max_err, _conv_tol, PAIRS_CASES, _in_bias_inputs
from test_kernels import _in_bias_reference, _dw_interpreted, _dw_reference, _cl_out_interpreted
out = []
for case in {cases}:
    made = {inputs}(case)
    x = made[0]
    # as made (the columns strided), then the channels-last layout (the channels contiguous, columns C apart)
    for layout in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
        args = (layout, *made[1:])
        got = {run}(*args)
        ref = {ref}(*args)
        shapes = [list(t.shape) for t in got] == [list(t.shape) for t in ref]
        out.append([_max_err(got, ref), {tolerance}, shapes])
print(json.dumps(out))
"""


def _interpreted(module: str, cases: str, inputs: str, tolerance: str, run: str, ref: str) -> list:
    """Run ``run`` (a kernel of ``module`` under Triton's interpreter) against ``ref`` in a subprocess
    (``TRITON_INTERPRET`` must be set before Triton is imported): ``[max error, tolerance, same shapes]`` per case."""
    return interpreted_json(INTERPRETED.format(module=module, cases=cases, inputs=inputs, tolerance=tolerance,
                                               run=run, ref=ref, tests=os.path.dirname(__file__)))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
@pytest.mark.parametrize("module, cases, inputs, tolerance, run, ref", [
    ("snake", "CASES", "_inputs", "5e-6", "snake.run_interpreted", "snake.reference"),  # Snake + state concatenation
    ("snake", "CASES", "_in_bias_inputs", "5e-6", "snake.run_interpreted", "_in_bias_reference"),  # ... of x + in_bias
    ("snake", "CASES", "_inputs", "5e-6", "_cl_out_interpreted", "snake.reference"),  # ... cat written channels-last
    ("transposed", "PAIRS_CASES", "_in_bias_inputs", "5e-6",  # Snake into frame pairs (the tiled kernel)
     "transposed.run_interpreted", "transposed.reference"),
    ("snake_conv", "CONV_CASES", "_conv_inputs", "_conv_tol(ref, 2e-6)",  # the last layer: Snake + conv to 1 channel
     "snake_conv.run_interpreted", "snake_conv.reference"),
    ("snake_conv", "CONV_CASES", "_conv_bias_inputs", "_conv_tol(ref, 2e-6)",  # ... of x plus pending biases
     "snake_conv.run_interpreted", "snake_conv.reference"),
    ("depthwise", "DW_CASES", "_dw_inputs", "_conv_tol(ref, 2e-6)", "_dw_interpreted", "_dw_reference"),
])
def test_kernel_indexing_matches_the_torch_expression_under_the_interpreter(module, cases, inputs, tolerance, run,
                                                                            ref):
    results = _interpreted(module, cases, inputs, tolerance, run, ref)
    expected = {"CASES": CASES, "CONV_CASES": CONV_CASES, "DW_CASES": DW_CASES, "PAIRS_CASES": PAIRS_CASES}[cases]
    assert len(results) == 2 * len(expected)  # each case in two layouts
    for case, (err, tol, same_shapes) in zip([c for c in expected for _ in range(2)], results):
        assert same_shapes, case
        assert err < tol, (case, err, tol)


SIN_SQUARED = """
import json
import numpy as np
import torch
import triton
import triton.language as tl
from code2wav.sidecar.kernels import snake_math

@triton.jit
def run(z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, snake_math.sin_squared(tl.load(z_ptr + i, mask=i < n)), mask=i < n)

gen = torch.Generator().manual_seed(0)
out = {}
for scale in (1.0, 30.0, 1e3, 1e5, 2.0 ** 20 / 4, 1e8):
    z = torch.randn(20000, generator=gen) * scale  # float32
    z[:4] = torch.tensor([0.0, 3.14159265 / 4, 3.14159265 / 2, -3.14159265])
    got = torch.empty_like(z)
    run[(triton.cdiv(z.numel(), 1024),)](z, got, z.numel(), BLOCK=1024)
    exact = torch.sin(z.double()) ** 2  # of the same float32 z
    out[str(scale)] = [(got.double() - exact).abs().max().item(), float(got.min()), float(got.max())]
special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
got = torch.empty_like(special)
run[(1,)](special, got, 4, BLOCK=1024)
out["nan, inf, -inf, 0"] = [v if v == v else "nan" for v in got.tolist()]
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_sin_squared_is_as_accurate_as_float32_sinf_where_activations_live_and_bounded_beyond():
    errors = interpreted_json(SIN_SQUARED)
    assert errors.pop("nan, inf, -inf, 0") == ["nan", "nan", "nan", 0.0]  # as sinf (the clamp keeps NaN)
    for scale, (err, low, high) in errors.items():
        assert 0.0 <= low and high <= 1.0, (scale, low, high)
        if float(scale) <= 2.0 ** 20 / 4:  # |z| < 2^20 (four standard deviations)
            assert err < 2.5e-7, (scale, err)  # float32 sinf squared: ~1.3e-7


def test_the_last_layer_cpu_op_is_snake_cat_then_conv1d_and_rejects_other_shapes():
    import torch.nn.functional as F

    for case in CONV_CASES:
        x, state, alpha, beta, lengths, log_params, weight, bias = _conv_inputs(case)
        y, tail = torch.ops.code2wav.snake_conv_out(x, state, alpha, beta, lengths, log_params, weight, bias)
        cat, ref_tail = torch.ops.code2wav.snake_cat(x, state, alpha, beta, lengths, log_params)
        assert torch.equal(y, F.conv1d(cat, weight, bias)) and torch.equal(tail, ref_tail)
        assert y.shape == (x.shape[0], 1, x.shape[2])
    x, state, alpha, beta, lengths, log_params, weight, bias = _conv_inputs(CONV_CASES[0])
    with pytest.raises(ValueError, match=r"\[1, 40, K\] weight"):  # two output channels
        torch.ops.code2wav.snake_conv_out(x, state, alpha, beta, lengths, log_params, weight.repeat(2, 1, 1), bias)
    with pytest.raises(ValueError, match="dilation 1"):  # a state that is not K - 1 columns
        torch.ops.code2wav.snake_conv_out(x, state[:, :, :3], alpha, beta, lengths, log_params, weight, bias)


def test_the_cpu_op_is_the_torch_expression_and_the_tail_is_the_next_state():
    for case in CASES:
        args = _inputs(case)
        cat, tail = torch.ops.code2wav.snake_cat(*args)
        ref_cat, ref_tail = snake.reference(*args)
        assert torch.equal(cat, ref_cat) and torch.equal(tail, ref_tail)
        x, state, alpha, beta, lengths, log_params = args
        num_state_cols = 0 if state is None else state.shape[2]
        assert cat.shape == (x.shape[0], x.shape[1], num_state_cols + x.shape[2])
        if state is not None:  # [state, act(x)]; the tail ends at each row's last valid column
            assert torch.equal(cat[:, :, :num_state_cols], state)
            for b, n in enumerate(lengths.tolist()):
                assert torch.equal(tail[b], cat[b, :, n:n + num_state_cols])
            with pytest.raises(ValueError, match="needs lengths"):  # None only without a state
                torch.ops.code2wav.snake_cat(x, state, alpha, beta, None, log_params)
        else:
            assert torch.equal(torch.ops.code2wav.snake_cat(x, None, alpha, beta, None, log_params)[0], cat)


@pytest.mark.parametrize("stride", [1, 2, 5])
def test_a_transposed_conv_of_kernel_stride_is_one_linear(stride):
    """``FrameTransposedConv`` equals ``conv_transpose1d`` of kernel = stride (no partial frames, no state), with and
    without its bias, from a contiguous or a channels-last input; its output is channels-last."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(stride)
    c_in, c_out, num_frames = 6, 4, 5
    weight = torch.randn(c_in, c_out, stride, generator=gen, dtype=torch.float64)
    bias = torch.randn(c_out, generator=gen, dtype=torch.float64)
    x = torch.randn(3, c_in, num_frames, generator=gen, dtype=torch.float64)
    conv = transposed.FrameTransposedConv(stride)
    for layout in (x, _channels_last(x)):
        for b in (bias, None):
            ref = F.conv_transpose1d(x, weight, b, stride=stride)  # [B, C_out, T s]
            y = conv(layout, weight, b)
            assert y.shape == ref.shape == (3, c_out, num_frames * stride) and y.stride(1) == 1
            assert (y - ref).abs().max().item() < 1e-12


def test_the_kernel_stride_transposed_conv_keeps_autograd_and_torch_compile_on_the_module():
    """``FrameTransposedConv`` detaches its weight copy and checks it by data pointer, so ``CausalTransConv`` runs it
    only where autograd is off and ``torch.compile`` is not tracing: with autograd on, gradients reach the weight
    and the bias; a compile after an eager call (which kept the copy) traces whole."""
    from code2wav.sidecar.models.streaming import CausalTransConv, StreamContext

    block = CausalTransConv(6, 4, 2, 2)
    x = torch.randn(2, 6, 5)
    lengths = torch.tensor([5, 3])
    with torch.inference_mode():
        frames, _ = block(x, lengths, StreamContext({}))  # the F.linear form, its weight copy kept
    assert frames.stride(1) == 1  # channels-last: the F.linear form ran
    y, _ = block(x, lengths, StreamContext({}))  # autograd on: the module's own conv
    y.sum().backward()
    assert block.conv.weight.grad is not None and block.conv.bias.grad is not None
    assert (y - frames).abs().max().item() < 1e-5

    def step(x):
        return block(x, lengths, StreamContext({}))[0]

    with torch.inference_mode():
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    assert (compiled - frames).abs().max().item() < 1e-5


@pytest.mark.parametrize("stride", [2, 3, 8])
def test_a_transposed_conv_is_one_gemm_over_frame_pairs(stride):
    """``transposed.conv`` over ``snake_pairs``' layout equals ``conv_transpose1d`` over ``[prev, x]`` with the
    partial first and last frames dropped, with and without its bias; its output is channels-last."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(stride)
    c_in, c_out, num_frames = 6, 4, 5
    weight = torch.randn(c_in, c_out, 2 * stride, generator=gen, dtype=torch.float64)
    bias = torch.randn(c_out, generator=gen, dtype=torch.float64)
    x_cat = torch.randn(2, c_in, 1 + num_frames, generator=gen, dtype=torch.float64)  # [prev, x]
    pairs = torch.cat([x_cat[:, :, :-1], x_cat[:, :, 1:]], dim=1).transpose(1, 2).contiguous()  # [B, L, 2 C_in]
    ref = F.conv_transpose1d(x_cat, weight, bias, stride=stride)[:, :, stride:(1 + num_frames) * stride]
    y = transposed.conv(pairs, transposed.pair_weight(weight, stride), bias, stride)
    assert y.shape == ref.shape == (2, c_out, num_frames * stride) and y.stride(1) == 1
    assert (y - ref).abs().max().item() < 1e-12
    no_bias = transposed.conv(pairs, transposed.pair_weight(weight, stride), None, stride)
    assert (no_bias + bias[None, :, None] - ref).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match=r"kernel size 2 \* stride"):
        transposed.pair_weight(weight[:, :, :-1], stride)


def test_the_pairs_cpu_op_is_snake_cat_written_as_frame_pairs_and_rejects_other_states():
    for case in PAIRS_CASES:
        x, state, alpha, beta, lengths, log_params, in_bias = _in_bias_inputs(case)
        pairs, tail = torch.ops.code2wav.snake_pairs(x, state, alpha, beta, lengths, log_params, in_bias)
        cat, ref_tail = torch.ops.code2wav.snake_cat(x, state, alpha, beta, lengths, log_params, in_bias)
        assert pairs.shape == (x.shape[0], x.shape[2], 2 * x.shape[1]) and torch.equal(tail, ref_tail)
        assert torch.equal(pairs[:, :, :x.shape[1]], cat[:, :, :-1].transpose(1, 2))  # frame t
        assert torch.equal(pairs[:, :, x.shape[1]:], cat[:, :, 1:].transpose(1, 2))  # frame t + 1
    x, state, alpha, beta, lengths, log_params, _ = _in_bias_inputs(PAIRS_CASES[1])
    with pytest.raises(ValueError, match=r"one-frame state \[B, C, 1\]"):
        torch.ops.code2wav.snake_pairs(x, state.repeat(1, 1, 2), alpha, beta, lengths, log_params)


def test_the_depthwise_cpu_op_is_conv1d_then_snake_and_rejects_other_shapes():
    import torch.nn.functional as F

    for case in DW_CASES:
        x, weight, bias, dilation, alpha, beta, log_params = _dw_inputs(case)
        y = torch.ops.code2wav.depthwise_snake(x, weight, bias, dilation, alpha, beta, log_params)
        h = F.conv1d(x, weight, bias, dilation=dilation, groups=x.shape[1])
        if alpha is None:
            assert torch.equal(y, h)
        else:  # the Snake of snake.py (its reference with no state), on the conv's output
            assert torch.equal(y, snake.reference(h, None, alpha, beta, torch.zeros(1), log_params)[0])
        assert y.is_contiguous()
        # a channels-last input: the same values, the output channels-last too (as the CUDA kernel writes it)
        y_cl = torch.ops.code2wav.depthwise_snake(_channels_last(x), weight, bias, dilation, alpha, beta, log_params)
        assert torch.equal(y_cl, y) and y_cl.stride() == (y.shape[1] * y.shape[2], 1, y.shape[1])
        fake = torch.empty_like(_channels_last(x), device="meta")
        y_meta = torch.ops.code2wav.depthwise_snake(fake, weight.to("meta"), bias.to("meta"), dilation,
                                                    None if alpha is None else alpha.to("meta"),
                                                    None if beta is None else beta.to("meta"), log_params)
        assert y_meta.stride() == y_cl.stride()  # the fake implementation agrees
    x, weight, bias, dilation, alpha, beta, log_params = _dw_inputs(DW_CASES[0])
    with pytest.raises(ValueError, match=r"weight \[C, 1, K\]"):  # a dense conv's weight
        torch.ops.code2wav.depthwise_snake(x, weight.repeat(1, 3, 1), bias, 1, alpha, beta, log_params)
    with pytest.raises(ValueError, match="at least 54 input columns"):
        torch.ops.code2wav.depthwise_snake(x[:, :, :20], weight, bias, 9, alpha, beta, log_params)


def test_fused_kernels_are_off_on_cpu_models():
    from code2wav.sidecar.models import load_model

    model = load_model("default", torch.device("cpu"), "float32")
    assert model.fused_kernels is False


@pytest.mark.parametrize("spec, activation", [("default", "SnakeBeta"), ("voxcpm2-default", "Snake")])
def test_the_family_switch_reaches_every_snake_and_cpu_tensors_keep_torch_ops(spec, activation):
    from code2wav.sidecar.models import StreamBatch, load_model

    model = load_model(spec, torch.device("cpu"), "float32")
    snakes = [m for m in model.module.modules() if type(m).__name__ == activation]
    assert snakes and not any(m.fused for m in snakes)
    inputs = torch.zeros(1, model.num_channels, 2, dtype=model.input.staged_dtype(model.dtype))
    batch = StreamBatch(inputs, torch.tensor([2]), torch.tensor([0]), model.zero_options(1))
    ref, _ = model.forward_stream(batch, model.zero_state(1))
    assert model.family.use_fused_kernels(model.module, True) is HAS_TRITON
    assert all(m.fused is HAS_TRITON for m in snakes)
    # blocks that call a kernel op themselves follow the same switch (both: the stateful convs' state join;
    # Qwen3-TTS also its depthwise convs and the transformer's rotary, inputs, norm and gate ops)
    switched = [m for m in model.module.modules() if hasattr(m, "kernels_on")]
    assert switched and all(m.kernels_on is HAS_TRITON for m in switched)
    got, _ = model.forward_stream(batch, model.zero_state(1))  # CPU tensors: the torch expression, same audio
    assert torch.equal(got, ref)
    assert model.family.use_fused_kernels(model.module, False) is False and not any(m.fused for m in snakes)
    assert not any(m.kernels_on for m in switched)


# ----------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.cuda


@pytest.fixture
def _tf32_off(no_tf32):
    """float32 tolerances hold only with TF32 off (conftest.no_tf32)."""


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@cuda
@pytest.mark.parametrize("op, inputs, reference, cases, fp32_rel", [
    ("snake_cat", _inputs, snake.reference, CASES, 5e-6),
    ("snake_cat", _in_bias_inputs, _in_bias_reference, CASES, 5e-6),  # of x plus pending biases
    ("snake_pairs", _in_bias_inputs, transposed.reference, PAIRS_CASES, 5e-6),
    ("depthwise_snake", _dw_inputs, depthwise.reference, DW_CASES, 2e-6),
])
def test_cuda_kernel_matches_its_torch_expression(_tf32_off, op, inputs, reference, cases, fp32_rel):
    """float32: the kernel against its expression; bf16: float32 math and one rounding, so within a bf16 step of
    the float32 expression of the same bf16 inputs. Each case with ``x`` as made and channels-last (the Snake
    kernels' tiled form)."""
    kernel = getattr(torch.ops.code2wav, op)
    layouts = (lambda x: x, _channels_last)  # depthwise_snake: a channels-last x runs the tiled kernel
    for case in cases:
        for layout in layouts:
            args = inputs(case, device="cuda")
            args = (layout(args[0]), *args[1:])
            ref = _as_tuple(reference(*args))
            assert _max_err(_as_tuple(kernel(*args)), ref) < _conv_tol(ref, fp32_rel), case
            bf = inputs(case, device="cuda", dtype=torch.bfloat16)
            bf = (layout(bf[0]), *bf[1:])
            exact = _as_tuple(reference(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                          for a in bf)))
            assert _max_err(_as_tuple(kernel(*bf)), exact) <= _conv_tol(exact, 0.0079), case


@cuda
def test_cuda_last_layer_kernel_matches_snake_then_conv(_tf32_off):
    for case, inputs in itertools.product(CONV_CASES, (_conv_inputs, _conv_bias_inputs)):  # with pending biases
        args = inputs(case, device="cuda")
        got = torch.ops.code2wav.snake_conv_out(*args)
        ref = snake_conv.reference(*args)
        assert _max_err(got, ref) < _conv_tol(ref, 2e-6), case
        bf = inputs(case, device="cuda", dtype=torch.bfloat16)
        got = torch.ops.code2wav.snake_conv_out(*bf)  # same roundings as snake_cat + a bf16 conv, sums reordered
        ref = snake_conv.reference(*bf)
        assert _max_err(got, ref) <= _conv_tol(ref, 2 * 0.0079), case  # 2 ulps: cuDNN rounds its own way


def _stream(model, chunks, num_slots=4):
    """Stream ``chunks`` (each ``[B, C, T]`` with per-row lengths) through ``forward_stream``; returns the audio
    of every call and the final state."""
    from code2wav.sidecar.models import StreamBatch

    state = model.zero_state(chunks[0][0].shape[0])
    positions = torch.zeros(chunks[0][0].shape[0], dtype=torch.long, device="cuda")
    audio = []
    with torch.inference_mode():
        for inputs, lengths in chunks:
            wav, state = model.forward_stream(StreamBatch(inputs, lengths, positions, model.zero_options(
                inputs.shape[0])), state)
            positions = positions + lengths
            audio.append(wav)
    return audio, state


def _chunks(model, sizes, seed):
    from code2wav.loadgen.inputs import InputContract, synthetic_inputs

    contract = InputContract.of(model)
    chunks = []
    for i, (num_frames, lengths) in enumerate(sizes):
        rows = [synthetic_inputs(contract, num_frames, seed=seed + 100 * i + b) for b in range(len(lengths))]
        inputs = torch.stack(rows).to("cuda")  # [B, C, T]
        chunks.append((inputs.to(model.input.staged_dtype(model.dtype)),
                       torch.tensor(lengths, dtype=torch.long, device="cuda")))
    return chunks


@cuda
@pytest.mark.parametrize("spec, sizes", [
    ("default", [(1, [1, 1]), (25, [25, 7]), (25, [25, 25])]),
    ("voxcpm2-default", [(4, [4, 4]), (25, [25, 3]), (4, [4, 4])]),
])
def test_decoders_stream_the_same_with_fused_kernels(_tf32_off, spec, sizes):
    from code2wav.sidecar.models import load_model

    model = load_model(spec, torch.device("cuda"), "float32")
    assert model.fused_kernels
    chunks = _chunks(model, sizes, seed=3)
    fused_audio, fused_state = _stream(model, chunks)
    model.family.use_fused_kernels(model.module, False)
    plain_audio, plain_state = _stream(model, chunks)
    # the fused transposed convs are one GEMM over frame pairs (K = 2 C_in, cuBLAS's summation order) where torch
    # ops run cuDNN's backward-data conv: float32 rounding through VoxCPM2's six 2048..32-channel upsampling blocks
    # reached 1.37e-5 on the H200, so 2e-5 (an indexing error would be of the order of the audio itself)
    for got, ref in zip(fused_audio, plain_audio):
        assert (got - ref).abs().max().item() < 2e-5
    # activations up to ~10: float32 rounding relative to their size. The fused path also runs the transformer's
    # norms and gates as Triton kernels (another summation order), and the Qwen3-TTS decoder's last state
    # (`decoder.6`, after every upsampling stage) reached 1.006e-5 of its largest value on the H200: 2e-5
    for key, ref in plain_state.items():
        assert (fused_state[key] - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item()), key


@cuda
def test_bf16_fused_kernels_are_not_less_faithful_than_torch_ops():
    from code2wav.sidecar.models import load_model

    sizes = [(1, [1, 1]), (25, [25, 25]), (25, [25, 11])]
    reference = load_model("default", torch.device("cuda"), "float32")
    reference.family.use_fused_kernels(reference.module, False)
    ref_audio, _ = _stream(reference, _chunks(reference, sizes, seed=5))
    model = load_model("default", torch.device("cuda"), "bfloat16")
    snr = {}
    for fused in (True, False):
        model.family.use_fused_kernels(model.module, fused)
        audio, _ = _stream(model, _chunks(model, sizes, seed=5))
        err = sum((a - r).pow(2).sum().item() for a, r in zip(audio, ref_audio))
        snr[fused] = 10 * torch.log10(torch.tensor(sum(r.pow(2).sum().item() for r in ref_audio) / err)).item()
    assert snr[True] >= snr[False] - 1.0, snr


@cuda
def test_a_graph_with_fused_kernels_equals_the_eager_torch_op_step(_tf32_off):
    from code2wav.sidecar.engine import DecodeItem, Engine
    from code2wav.sidecar.graphs.manager import GraphManager
    from code2wav.sidecar.graphs.plan import BucketKey
    from code2wav.sidecar.graphs.routine import StreamRoutine
    from code2wav.sidecar.metrics import Metrics
    from code2wav.sidecar.models import load_model
    from code2wav.sidecar.state_store import StateArena
    from prometheus_client import CollectorRegistry

    model = load_model("default", torch.device("cuda"), "float32")
    arena = StateArena(model.module.state_layout(), 8, model.dtype, model.device)
    key = BucketKey("exact", 4, 25)
    manager = GraphManager({"exact": StreamRoutine(model, arena, 4, 25)}, (key,), model.device,
                           Metrics(CollectorRegistry()), max_graph_memory_bytes=None)
    manager.capture_startup()
    assert manager.is_captured(key)
    gen = torch.Generator().manual_seed(9)
    slots = [arena.allocate() for _ in range(3)]  # 3 rows in a 4-row bucket: one padding row
    codes = [torch.randint(0, model.codebook_size, (model.num_quantizers, n), generator=gen) for n in (25, 25, 9)]
    items = [DecodeItem(codes=c, slot=s, skip_frames=0) for c, s in zip(codes, slots)]
    snapshot = {k: t.clone() for k, t in arena.tensors.items()}, arena.positions.clone()
    graph_audio = [a.clone() for a in manager.replay(key, items)]
    graph_state = {k: t.clone() for k, t in arena.tensors.items()}
    for k, t in arena.tensors.items():
        t.copy_(snapshot[0][k])
    arena.positions.copy_(snapshot[1])
    model.family.use_fused_kernels(model.module, False)
    eager_audio = Engine(model, arena).decode(items)
    for got, ref in zip(graph_audio, eager_audio):  # the exact mode's float32 tolerance on CUDA, 1e-4 (the forms
        # each conv runs in are timed per machine: an H100 of 2026-12-07 gave 1.08e-5 where 1e-5 was asked)
        assert got.shape == ref.shape and (got - ref).abs().max().item() < 1e-4
    for k, t in arena.tensors.items():  # activations up to ~10: float32 rounding relative to their size (the
        # 4-row graph and the 3-row eager step may run a conv in different forms: kernels/conv_choice.py)
        ref = t[slots]
        assert (graph_state[k][slots] - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item()), k
