"""A residual unit's second half in one kernel (``sidecar/kernels/unit_tma.py``).

CPU: which tiles fit which channel counts (pure); the kernel's indexing under Triton's interpreter equals the
unfused expression (conv1 + Snake, rounded, then ``x + W2 @ h``) with partial tiles, channels past a tile part and
one output column; the CPU op is the reference and writes in place; a conv asked with the unit's rest returns the
stream updated in place, and no TMA form is offered for a CPU tensor. CUDA: at the decoder's 96- and 192-channel
shapes (batches 1, 3 and 64; 1, 4 and 25 frames) the kernel equals the float32 unit within bf16's tolerance, and
equals the unfused bf16 forms run the same way (``conv_snake_cl`` then ``baddbmm``).
"""

from __future__ import annotations

import os

import pytest
import torch

from code2wav.sidecar.kernels import conv_gemm_tma, snake_math, unit_tma
from code2wav.sidecar.kernels.conv_gemm_tma import TmaTile

HAS_TRITON = conv_gemm_tma.triton is not None


def test_a_tile_fits_the_channels_its_two_parts_cover():
    assert unit_tma.fits(192, TmaTile(128, 64, 128, 64, 8, 3)) and unit_tma.fits(96, TmaTile(64, 32, 256, 32, 8, 3))
    assert not unit_tma.fits(96, TmaTile(128, 64, 128, 64, 8, 3))  # the second part would be idle
    assert not unit_tma.fits(384, TmaTile(128, 64, 128, 64, 8, 3))  # past one program
    assert [c for c in (64, 96, 192, 384, 768) if any(unit_tma.fits(c, t) for t in unit_tma.CONFIGS)] == [96, 192]


CASES = [  # (batch, channels, output columns, kernel size, dilation, layout of a)
    (2, 24, 70, 7, 3, "cl"),  # 24 channels: the second part (16 + 16) half past C
    (1, 32, 1, 7, 9, "cl"),  # one output column
    (3, 24, 33, 7, 1, "cf"),  # a channels-first input (copied to channels-last first)
]


def _inputs(case):
    batch, channels, num_cols, ksize, dilation, layout = case
    gen = torch.Generator().manual_seed(num_cols + channels)
    a = torch.randn(batch, channels, num_cols + (ksize - 1) * dilation, generator=gen)
    if layout == "cl":
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    weight = torch.randn(channels, channels, ksize, generator=gen) / (channels * ksize) ** 0.5
    bias = torch.randn(channels, generator=gen)
    alpha, beta = torch.randn(2, channels, generator=gen) * 0.3
    w2 = torch.randn(channels, channels, generator=gen) / channels ** 0.5
    x = torch.randn(batch, channels, num_cols, generator=gen)
    return a, weight, bias, dilation, alpha, beta, True, w2, x


INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_unit_tma import CASES, _inputs
from code2wav.sidecar.kernels import unit_tma
from code2wav.sidecar.kernels.conv_gemm_tma import TmaTile
out = []
for case in CASES:
    *args, x = _inputs(case)
    ref = unit_tma.reference(*args, x)
    for config in (TmaTile(16, 16, 16, 16, 1, 1), TmaTile(16, 16, 32, 8, 1, 1)):
        got = x.clone()
        unit_tma.run_interpreted(*args, got, config=config)
        out.append((got - ref).abs().max().item())
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_the_kernel_indexing_matches_the_unfused_unit_under_the_interpreter():
    from conftest import interpreted_json

    errors = interpreted_json(INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(errors) == 2 * len(CASES) and max(errors) < 1e-5, errors


def test_the_cpu_op_is_the_reference_written_in_place():
    for case in CASES:
        *args, x = _inputs(case)
        ref = unit_tma.reference(*args, x)
        torch.ops.code2wav.unit_tail_tma(*args, x, [16, 16, 16, 16, 1, 1])
        assert torch.equal(x, ref)
    *args, x = _inputs(CASES[0])
    with pytest.raises(ValueError, match="residual"):
        torch.ops.code2wav.unit_tail_tma(*args, x[:, :, 1:], [16, 16, 16, 16, 1, 1])


@pytest.mark.cuda
@pytest.mark.parametrize("batch, channels, frames, dilation", [
    (64, 96, 25, 9), (3, 96, 4, 3), (1, 96, 1, 1), (64, 192, 25, 1), (3, 192, 4, 9), (1, 192, 1, 3),
])
def test_the_kernel_equals_the_unit_on_the_gpu(no_tf32, batch, channels, frames, dilation):
    cols_per_frame = 1920 if channels == 96 else 640  # the decoder's last two levels at 24 kHz
    num_cols = frames * cols_per_frame
    gen = torch.Generator(device="cuda").manual_seed(num_cols + channels)
    a = torch.randn(batch, channels, num_cols + 6 * dilation, device="cuda", generator=gen)
    weight = torch.randn(channels, channels, 7, device="cuda", generator=gen) / (7 * channels) ** 0.5
    bias, alpha, beta = (torch.randn(3, channels, device="cuda", generator=gen) * 0.3).unbind(0)
    w2 = torch.randn(channels, channels, device="cuda", generator=gen) / channels ** 0.5
    x = torch.randn(batch, channels, num_cols, device="cuda", generator=gen)
    ref = unit_tma.reference(a, weight, bias, dilation, alpha, beta, True, w2, x)  # float32
    bf = torch.bfloat16
    a_cl = a.to(bf).transpose(1, 2).contiguous().transpose(1, 2)  # as the Snake kernel writes it
    args = (a_cl, conv_gemm_tma.kernel_weight(weight.to(bf)), bias.to(bf), dilation, alpha.to(bf), beta.to(bf), True,
            w2.to(bf))
    h = torch.ops.code2wav.conv_snake_cl(*args[:7], [128, 128, 64, 8, 3])  # the unfused bf16 unit
    unfused = torch.baddbmm(x.to(bf), w2.to(bf).expand(batch, -1, -1), h)
    with torch.inference_mode():
        for config in unit_tma.CONFIGS:
            if not unit_tma.fits(channels, config):
                continue
            got = x.to(bf)
            torch.ops.code2wav.unit_tail_tma(*args, got, list(config))
            scale = ref.abs().max().item()
            assert (got.float() - ref).abs().max().item() < 0.03 * scale, config
            assert (got.float() - unfused.float()).abs().max().item() < 0.01 * scale, config


def test_a_conv_asked_with_the_units_rest_returns_the_stream_updated_in_place():
    """``ConvChoice`` with ``residual`` (a unit's conv1): on the CPU cuDNN's form then the unit's own finish; the
    stream itself comes back, equal to the unfused unit; the fused form refuses a call without the unit's rest."""
    from code2wav.sidecar.kernels.conv_choice import ConvChoice, epilogue
    from code2wav.sidecar.kernels.conv_forms import ConvForms

    a, weight, bias, dilation, alpha, beta, log_params, w2, x = _inputs(CASES[0])
    conv = torch.nn.Conv1d(weight.shape[1], weight.shape[0], weight.shape[2], dilation=dilation)
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
    ref = unit_tma.reference(a, weight, bias, dilation, alpha, beta, log_params, w2, x)
    calls = []

    def finish(stream, h):
        calls.append(h.shape)
        return torch.baddbmm(stream, w2.expand(stream.shape[0], -1, -1), h, out=stream)

    with torch.inference_mode():
        stream = x.clone()
        got = ConvChoice()(a, conv, act=(alpha, beta, log_params), residual=(w2, stream, finish))
    assert got is stream and calls == [ref.shape] and (got - ref).abs().max().item() < 1e-5
    assert [epilogue(None, None), epilogue((alpha, beta, log_params), None),
            epilogue((alpha, beta, log_params), (w2, x, finish))] == [0, 1, 2]
    with pytest.raises(ValueError, match="residual"):
        ConvForms().run("unit_tma0", a, conv, True, (alpha, beta, log_params), None)
    offered = ConvForms().offered(a.bfloat16(), conv.bfloat16(), True, residual=True)  # a CPU tensor: no TMA
    assert "gemm_cl0" in offered and not any(f.startswith(("gemm_tma", "unit_tma")) for f in offered)


def test_an_input_sharing_the_residuals_memory_is_refused():
    *args, x = _inputs(CASES[0])
    a = args[0]
    shared = torch.empty(a.numel() + x.numel())
    a_view = shared[:a.numel()].view(a.shape[0], a.shape[2], a.shape[1]).transpose(1, 2)  # [B, C, P + T]
    with pytest.raises(ValueError, match="share memory"):
        torch.ops.code2wav.unit_tail_tma(a_view, *args[1:], shared[a.numel():].view(x.shape), [16, 16, 16, 16, 1, 1])
