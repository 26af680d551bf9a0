"""The forms a dense conv can run in and the measured choice between them (``sidecar/kernels/conv_choice.py``):
cuDNN, a dilated conv as one undilated conv over its phases (``dilated.py``) and the implicit-GEMM Triton kernel
with its Snake epilogue (``conv_gemm.py``).

Also cuDNN on channels-last tensors (``"cudnn_cl"``), for callers that write their input that way.

CPU: ``polyphase_conv`` equals ``F.conv1d`` with the dilation for lengths that the dilation divides and that it
does not, grouped convs and a single output column; the whole decoder with every dilated conv in the polyphase form
streams the golden; the GEMM kernel's indexing under Triton's interpreter equals conv1d (+ Snake); the choice leaves
CPU tensors to cuDNN and returns ``act(conv + bias)`` when asked. CUDA: every form equals the conv, the choice times
the forms once per shape and keeps the result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from code2wav.sidecar.kernels import conv_choice, conv_forms, conv_gemm, conv_gemm_cl, snake_math
from code2wav.sidecar.kernels.conv_choice import ConvChoice
from code2wav.sidecar.kernels.dilated import polyphase_conv

HAS_TRITON = conv_gemm.triton is not None


@pytest.mark.parametrize("batch, channels, out_channels, ksize, dilation, num_in, groups", [
    (2, 6, 4, 7, 9, 4054, 1),  # the length is not a multiple of the dilation
    (1, 5, 5, 7, 3, 18 + 300, 1),  # a multiple
    (3, 8, 8, 7, 3, 18 + 1, 8),  # depthwise; one output column
    (2, 4, 6, 3, 2, 11, 2),
])
def test_polyphase_conv_equals_the_dilated_conv(batch, channels, out_channels, ksize, dilation, num_in, groups):
    gen = torch.Generator().manual_seed(dilation + num_in)
    x = torch.randn(batch, channels, num_in, generator=gen)
    weight = torch.randn(out_channels, channels // groups, ksize, generator=gen)
    bias = torch.randn(out_channels, generator=gen)
    ref = F.conv1d(x, weight, bias, dilation=dilation, groups=groups)
    got = polyphase_conv(x, weight, bias, dilation, groups)
    assert got.shape == ref.shape == (batch, out_channels, num_in - (ksize - 1) * dilation)
    assert (got - ref).abs().max().item() < 1e-4


def test_the_choice_leaves_cpu_tensors_to_cudnn_and_applies_the_snake_it_is_given():
    choice = ConvChoice()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 40, generator=gen)
    alpha, beta = torch.randn(2, 4, generator=gen) * 0.3
    for conv in (torch.nn.Conv1d(4, 4, 7, dilation=3), torch.nn.Conv1d(4, 4, 7)):
        assert torch.equal(choice(x, conv), conv(x))
        no_bias = choice(x, conv, with_bias=False)
        assert torch.allclose(no_bias + conv.bias[None, :, None], conv(x), atol=1e-6)
        activated = choice(x, conv, act=(alpha, beta, True))
        assert torch.allclose(activated, snake_math.activate(conv(x), alpha, beta, True), atol=1e-6)
    assert choice.decisions == {}  # nothing measured on the CPU


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_the_gemm_kernel_is_a_form_only_with_the_kernels_on_and_autograd_off():
    from code2wav.sidecar.models import load_model

    conv = torch.nn.Conv1d(8, 8, 7, dilation=3).to(torch.bfloat16)
    x = torch.zeros(1, 8, 30, dtype=torch.bfloat16)
    choice = ConvChoice()
    with torch.inference_mode():  # engine.fused_kernels off (the default)
        assert choice.offered(x, conv) == ["cudnn", "cudnn_cl", "polyphase", "im2col"]
        choice.kernels = True
        assert "gemm0" in choice.offered(x, conv) and "gemm0" not in choice.offered(x.float(), conv.float())
        assert "gemm_cl0" in choice.offered(x, conv)  # 8 input channels: 16-byte rows
        assert "gemm_cl0" not in choice.offered(x[:, :6], torch.nn.Conv1d(6, 8, 7).to(torch.bfloat16))
        choice.allowed = ("gemm_cl",)  # a diagnostic run's restriction: cuDNN always stays
        assert choice.offered(x, conv) == ["cudnn"] + [f"gemm_cl{i}" for i in range(len(conv_gemm_cl.CONFIGS))]
        choice.allowed = None
    assert choice.offered(x, conv) == ["cudnn", "polyphase"]  # autograd on: no kernel (no backward), no copies
    model = load_model("default", torch.device("cpu"), "float32")
    choices = [m.choice for m in model.module.modules() if isinstance(getattr(m, "choice", None), ConvChoice)]
    assert len(choices) == 14  # pre_conv, the first decoder conv, the 12 residual units' dilated convs
    model.family.use_fused_kernels(model.module, True)
    assert all(c.kernels for c in choices)
    model.family.use_fused_kernels(model.module, False)
    assert not any(c.kernels for c in choices)


GEMM_CASES = [  # (batch, C_in, C_out, output columns, kernel size, dilation, Snake after: None | log_params)
    (2, 20, 36, 70, 7, 3, True),  # partial tiles on every edge
    (1, 8, 16, 1, 7, 9, False),  # one output column (a first chunk)
    (3, 33, 17, 40, 3, 1, None),  # the conv alone, an input-channel count no tile divides
]


def _gemm_inputs(case):
    batch, c_in, c_out, num_cols, ksize, dilation, act = case
    gen = torch.Generator().manual_seed(num_cols)
    num_in = num_cols + (ksize - 1) * dilation
    x = torch.randn(batch, c_in, num_in + 3, generator=gen)[:, :, 2:2 + num_in]  # strided
    weight = torch.randn(c_out, c_in, ksize, generator=gen) / (c_in * ksize) ** 0.5
    bias = torch.randn(c_out, generator=gen)
    alpha, beta = torch.randn(2, c_out, generator=gen) * 0.3 + (0.0 if act else 1.0)
    params = (None, None, False) if act is None else (alpha, beta, act)
    return x, weight, bias, dilation, *params


GEMM_INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_conv_choice import GEMM_CASES, _gemm_inputs
from code2wav.sidecar.kernels import conv_gemm
out = []
for case in GEMM_CASES:
    x, weight, *rest = _gemm_inputs(case)
    for layout in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):  # columns strided, then channels last
        got = conv_gemm.run_interpreted(layout, conv_gemm.kernel_weight(weight), *rest)
        ref = conv_gemm.reference(layout, weight, *rest)
        out.append([list(got.shape) == list(ref.shape), (got - ref).abs().max().item()])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_the_gemm_kernel_indexing_matches_conv1d_under_the_interpreter():
    import os

    from conftest import interpreted_json

    results = interpreted_json(GEMM_INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(results) == 2 * len(GEMM_CASES)  # each case in two layouts
    for case, (same_shape, err) in zip([c for c in GEMM_CASES for _ in range(2)], results):
        assert same_shape and err < 1e-5, (case, err)


def test_the_gemm_cpu_op_is_conv1d_then_snake_and_rejects_other_shapes():
    for case in GEMM_CASES:
        x, weight, bias, dilation, alpha, beta, log_params = _gemm_inputs(case)
        y = torch.ops.code2wav.conv_snake(x, weight, bias, dilation, alpha, beta, log_params, [16, 16, 16, 1, 1])
        assert torch.equal(y, conv_gemm.reference(x, weight, bias, dilation, alpha, beta, log_params))
    x, weight, bias, *rest = _gemm_inputs(GEMM_CASES[0])
    with pytest.raises(ValueError, match=r"weight \[C_out, C_in, K\]"):  # a grouped conv's weight
        torch.ops.code2wav.conv_snake(x, weight[:, :10], bias, *rest, [16, 16, 16, 1, 1])
    with pytest.raises(ValueError, match="at least 18 input columns"):
        torch.ops.code2wav.conv_snake(x[:, :, :10], weight, bias, *rest, [16, 16, 16, 1, 1])


def test_only_unpadded_stride_1_convs_are_polyphase_candidates():
    assert conv_choice.plain(torch.nn.Conv1d(4, 4, 7, dilation=3))
    assert not conv_choice.plain(torch.nn.Conv1d(4, 4, 7, dilation=3, padding=9))
    assert not conv_choice.plain(torch.nn.Conv1d(4, 4, 7, dilation=3, stride=2))
    assert not conv_choice.plain(torch.nn.Conv1d(4, 4, 7, dilation=3, padding=9, padding_mode="reflect"))


def test_the_decoder_streams_the_golden_with_every_dilated_conv_polyphase(monkeypatch, golden_cases):
    """What a GPU whose measurements all favour the polyphase form runs, on the CPU: forced for every dilated conv
    (the choice never picks on CPU tensors), the golden streamed in chunks 1, 16, 23 within 1e-5."""
    calls = []

    def always_polyphase(self, x, conv, with_bias=True, act=None, channels_last_ok=False):
        if conv.dilation[0] == 1:
            return self.run("cudnn", x, conv, with_bias, act)
        calls.append(tuple(x.shape))
        return self.run("polyphase", x, conv, with_bias, act)

    monkeypatch.setattr(ConvChoice, "__call__", always_polyphase)
    _assert_streams_the_golden(golden_cases)
    assert calls  # the dilated convs ran through the polyphase form


def _assert_streams_the_golden(golden_cases) -> None:
    """The tiny Qwen3-TTS golden, two rows streamed in chunks of 1, 16 and the rest, within 1e-5 of ``full``."""
    from test_exact_streaming import make_engine, stream_interleaved

    from code2wav.sidecar.models import load_model
    from conftest import TINY

    engine = make_engine(load_model(str(TINY), torch.device("cpu"), "float32"))
    full = golden_cases["full"][:, 0]  # [2, T * U]
    num_frames = golden_cases["codes"].shape[2]
    plan = [1, 16, num_frames - 17]
    with torch.inference_mode():
        out_a, out_b = stream_interleaved(engine, golden_cases["codes"], [plan, plan])
    assert (out_a - full[0]).abs().max().item() <= 1e-5
    assert (out_b - full[1]).abs().max().item() <= 1e-5


def test_the_decoder_streams_the_golden_with_every_conv_channels_last(monkeypatch, golden_cases):
    """What a GPU whose measurements all favour cuDNN on channels-last tensors runs, on the CPU: the fused path
    forced (its ops' torch expressions), every dense conv asking for its input channels-last and run as ``conv2d``
    over ``[B, C, 1, L]``; the Snake after it reads the channels-last output. The golden streams within 1e-5."""
    from code2wav.sidecar.models.qwen3_tts.blocks import SnakeBeta

    monkeypatch.setattr(SnakeBeta, "runs_fused", lambda self, x: True)
    calls = []

    def always_channels_last(self, x, conv, with_bias=True, act=None, channels_last_ok=False, residual=None):
        if channels_last_ok:
            assert x.stride(1) == 1 and x.shape[1] > 1  # written channels-last by the Snake kernel's op
        calls.append((tuple(x.shape), channels_last_ok, residual is not None))
        return self.run("cudnn_cl", x, conv, with_bias, act, residual)  # otherwise the form copies x to channels-last

    monkeypatch.setattr(ConvChoice, "__call__", always_channels_last)
    monkeypatch.setattr(ConvChoice, "wants_channels_last", lambda self, *args: True)
    _assert_streams_the_golden(golden_cases)
    assert {ok for _, ok, _ in calls} == {True, False}  # the residual units' convs, and pre_conv and the first conv
    assert {ok for _, ok, unit in calls if unit} == {True}  # each unit's conv1 asked with the unit's rest (finished)


def test_the_channels_last_form_is_offered_where_autograd_is_off_and_takes_either_layout():
    conv = torch.nn.Conv1d(8, 8, 7, dilation=3)
    x = torch.randn(2, 8, 40)
    choice = ConvChoice()
    assert "cudnn_cl" not in choice.offered(x, conv)  # autograd on: its weight copy is detached
    with torch.inference_mode():
        assert "cudnn_cl" in choice.offered(x, conv)
    assert not choice.wants_channels_last((2, 8, 40), x.dtype, x.device, False)  # nothing measured yet
    with torch.inference_mode():  # written channels-last by the caller, or copied so by the form itself
        for layout in (x.transpose(1, 2).contiguous().transpose(1, 2), x):
            got = choice.run("cudnn_cl", layout, conv, True, None)
            assert got.stride(1) == 1 and (got - conv(x)).abs().max().item() < 1e-5


@pytest.mark.cuda
def test_every_form_equals_the_conv_on_cuda(no_tf32):
    """fp32 (TF32 off): cuDNN and the polyphase form; bf16: the GEMM kernel's tile configs too, with and without
    its Snake epilogue, against the float32 conv."""
    conv = torch.nn.Conv1d(96, 80, 7, dilation=3).cuda()
    alpha, beta = (torch.randn(2, 80, device="cuda") * 0.3).unbind(0)
    choice = ConvChoice()
    choice.kernels = True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        x = torch.randn(3, 96, 18 + 301, device="cuda")
        ref = conv(x)
        ref_act = snake_math.activate(ref, alpha, beta, True)
        layer = torch.nn.Conv1d(96, 80, 7, dilation=3).cuda().to(dtype)
        layer.load_state_dict(conv.state_dict())
        assert "gemm0" not in choice.offered(x.to(dtype), layer)  # autograd on: no kernel without a backward
        with torch.inference_mode():
            assert ("gemm0" in choice.offered(x.to(dtype), layer)) == (dtype == torch.bfloat16)
            assert ("gemm_cl0" in choice.offered(x.to(dtype), layer)) == (dtype == torch.bfloat16)
            hopper = torch.cuda.get_device_capability()[0] >= 9
            assert ("gemm_tma0" in choice.offered(x.to(dtype), layer)) == (dtype == torch.bfloat16 and hopper)
            forms = choice.offered(x.to(dtype), layer)
            assert "cudnn_cl" in forms and "im2col" in forms  # offered to every dense conv
            inputs = [(form, x.to(dtype)) for form in forms]
            # the channels-last forms also as a Snake kernel writes their input for them: channels-last
            inputs += [(form, x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)) for form in forms
                       if conv_forms.reads_channels_last(form)]
            for form, x_in in inputs:
                got = choice.run(form, x_in, layer, True, None)
                assert (got.float() - ref).abs().max().item() < tol * ref.abs().max().item(), (dtype, form)
                got = choice.run(form, x_in, layer, True, (alpha.to(dtype), beta.to(dtype), True))
                assert (got.float() - ref_act).abs().max().item() < tol * ref_act.abs().max().item(), (dtype, form)


@pytest.mark.cuda
def test_the_choice_is_measured_once_per_shape_and_keeps_the_output(no_tf32):
    choice = ConvChoice()
    choice.kernels = True
    conv = torch.nn.Conv1d(64, 64, 7, dilation=9).cuda().to(torch.bfloat16)
    with torch.inference_mode():
        for num_in in (54 + 400, 54 + 401, 54 + 400):
            x = torch.randn(4, 64, num_in, device="cuda", dtype=torch.bfloat16)
            got = choice(x, conv, channels_last_ok=True)  # x contiguous: cudnn_cl, if chosen, copies it
            ref = conv(x).float()
            assert (got.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert len(choice.decisions) == 2 and len(choice.timings_ms) == 2  # the repeated shape was not timed again
    with torch.inference_mode():
        offered = set(choice.offered(x, conv))
    assert {"gemm0", "gemm_cl0", "im2col", "polyphase"} <= offered
    for timings in choice.timings_ms.values():
        assert set(timings) == offered  # every offered form timed (none failed)
        assert all(ms > 0 for ms in timings.values())


def _key(batch: int, channels: int, length: int, with_act: bool = True, kernels: bool = True) -> tuple:
    return (batch, channels, length, torch.bfloat16, torch.device("cuda", 0), with_act, kernels)


def test_a_new_shape_once_measuring_stopped_takes_the_nearest_measured_shapes_form():
    """Policy, on plain keys (no device): the nearest measured shape by columns (batch x length) of the same conv
    input (channels, dtype, device, Snake, kernels), never an inferred one; a form this shape cannot run falls back
    to cuDNN channels-last, then cuDNN; the decision is counted as inferred, and nothing is measured."""
    measured = {_key(1, 768, 80): "cudnn_cl", _key(16, 768, 1206): "gemm_cl3", _key(16, 768, 82): "gemm_cl0",
                _key(16, 384, 9000): "gemm_cl4", _key(16, 768, 5000, with_act=False): "im2col"}
    assert conv_choice.nearest_form(measured, _key(16, 768, 7206)) == "gemm_cl3"  # 115k columns: nearest 19k
    assert conv_choice.nearest_form(measured, _key(1, 768, 81)) == "cudnn_cl"  # 81 columns: nearest 80
    assert conv_choice.nearest_form(measured, _key(2, 768, 80)) == "cudnn_cl"  # 160: 80 (distance 80) beats 1312
    assert conv_choice.nearest_form(measured, _key(16, 768, 7206, with_act=False)) == "im2col"  # Snake apart
    assert conv_choice.nearest_form(measured, _key(16, 192, 7206)) is None  # no shape of these channels
    choice = ConvChoice()
    choice.kernels = True
    for key, form in measured.items():
        choice.decisions[key], choice.timings_ms[key] = form, {form: 1.0, "cudnn": 2.0}
    assert conv_choice.stop_measuring(torch.nn.Module()) == 0
    holder = torch.nn.Module()
    holder.choice = choice  # a module holding a choice, as the kit's convs do
    assert conv_choice.stop_measuring(holder) == 1 and not choice.measure_new
    assert choice.infer(_key(16, 768, 7206), ["cudnn", "cudnn_cl", "gemm_cl3"]) == "gemm_cl3"
    assert choice.infer(_key(16, 768, 7207), ["cudnn", "cudnn_cl"]) == "cudnn_cl"  # gemm_cl3 not offered here
    assert choice.infer(_key(16, 768, 7208), ["cudnn"]) == "cudnn"
    assert choice.infer(_key(16, 192, 100), ["cudnn", "cudnn_cl"]) == "cudnn_cl"  # nothing near: cuDNN channels-last
    # an inferred decision is never a neighbour: the nearest measured shape decides, not 7208's cuDNN just inferred
    assert choice.infer(_key(16, 768, 7209), ["cudnn", "cudnn_cl", "gemm_cl3", "gemm_cl0"]) == "gemm_cl3"
    with torch.inference_mode():  # the key's kernels flag as the caller's would be (Triton installed or not)
        kernels = choice.kernels_allowed()
        choice.decisions[_key(16, 768, 1206, kernels=kernels)] = "gemm_cl3"
        choice.timings_ms[_key(16, 768, 1206, kernels=kernels)] = {"gemm_cl3": 1.0}
        assert choice.wants_channels_last((16, 768, 9000), torch.bfloat16, torch.device("cuda", 0), True)
        assert not choice.wants_channels_last((16, 192, 9000), torch.bfloat16, torch.device("cuda", 0), True)
    decisions, _ = choice.events.snapshot()
    assert decisions == {("gemm_cl3", "inferred"): 2, ("cudnn_cl", "inferred"): 2, ("cudnn", "inferred"): 1}
    assert set(choice.timings_ms) == set(measured) | {_key(16, 768, 1206, kernels=kernels)}  # nothing measured


@pytest.mark.cuda
def test_once_measuring_stopped_a_new_shape_runs_unmeasured_and_keeps_the_output(no_tf32):
    choice = ConvChoice()
    choice.kernels = True
    conv = torch.nn.Conv1d(64, 64, 7, dilation=9).cuda().to(torch.bfloat16)
    holder = torch.nn.Module()
    holder.choice = choice
    with torch.inference_mode():
        x = torch.randn(4, 64, 54 + 400, device="cuda", dtype=torch.bfloat16)
        choice(x, conv, channels_last_ok=True)  # measured: start-up
        conv_choice.stop_measuring(holder)
        for num_in in (54 + 401, 54 + 4000):  # serving: new shapes
            x = torch.randn(4, 64, num_in, device="cuda", dtype=torch.bfloat16)
            got = choice(x, conv, channels_last_ok=True)
            ref = conv(x).float()
            assert (got.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert len(choice.timings_ms) == 1 and len(choice.decisions) == 3  # two shapes decided, not measured
    decisions, _ = choice.events.snapshot()
    assert sum(n for (_, source), n in decisions.items() if source == "inferred") == 2
