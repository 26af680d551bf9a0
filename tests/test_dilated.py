"""Dilated convs as one undilated conv over their phases (``sidecar/kernels/dilated.py``), and the measured choice.

CPU: ``polyphase_conv`` equals ``F.conv1d`` with the dilation for lengths that the dilation divides and that it
does not, grouped convs and a single output column; the whole decoder with every dilated conv in the polyphase form
streams the golden; the choice leaves CPU tensors, undilated convs and convs with padding or a stride to the conv as
it is. CUDA: the choice times both forms once per shape and keeps the result, and whichever it picks gives the
conv's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from code2wav.sidecar.kernels import dilated
from code2wav.sidecar.kernels.dilated import DilatedConvChoice, polyphase_conv


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


def test_the_choice_leaves_cpu_tensors_and_undilated_convs_to_the_conv():
    choice = DilatedConvChoice()
    x = torch.randn(2, 4, 40)
    for conv in (torch.nn.Conv1d(4, 4, 7, dilation=3), torch.nn.Conv1d(4, 4, 7)):
        assert torch.equal(choice(x, conv), conv(x))
    assert choice.decisions == {}  # nothing measured on the CPU


def test_only_unpadded_stride_1_convs_are_polyphase_candidates():
    assert dilated._plain(torch.nn.Conv1d(4, 4, 7, dilation=3))
    assert not dilated._plain(torch.nn.Conv1d(4, 4, 7, dilation=3, padding=9))
    assert not dilated._plain(torch.nn.Conv1d(4, 4, 7, dilation=3, stride=2))
    assert not dilated._plain(torch.nn.Conv1d(4, 4, 7, dilation=3, padding=9, padding_mode="reflect"))


def test_the_decoder_streams_the_golden_with_every_dilated_conv_polyphase(monkeypatch, golden_cases):
    """What a GPU whose measurements all favour the polyphase form runs, on the CPU: forced for every dilated conv
    (the choice never picks on CPU tensors), the golden streamed in chunks 1, 16, 23 within 1e-5."""
    from test_exact_streaming import make_engine, stream_interleaved

    from code2wav.sidecar.models import load_model
    from conftest import TINY

    calls = []

    def always_polyphase(self, x, conv, with_bias=True):
        calls.append(tuple(x.shape))
        return polyphase_conv(x, conv.weight, conv.bias if with_bias else None, conv.dilation[0], conv.groups)

    monkeypatch.setattr(DilatedConvChoice, "__call__", always_polyphase)
    engine = make_engine(load_model(str(TINY), torch.device("cpu"), "float32"))
    full = golden_cases["full"][:, 0]  # [2, T * U]
    num_frames = golden_cases["codes"].shape[2]
    plan = [1, 16, num_frames - 17]
    with torch.inference_mode():
        out_a, out_b = stream_interleaved(engine, golden_cases["codes"], [plan, plan])
    assert calls  # the dilated convs ran through the polyphase form
    assert (out_a - full[0]).abs().max().item() <= 1e-5
    assert (out_b - full[1]).abs().max().item() <= 1e-5


@pytest.mark.cuda
def test_the_choice_is_measured_once_per_shape_and_keeps_the_output(no_tf32):
    choice = DilatedConvChoice()
    conv = torch.nn.Conv1d(64, 64, 7, dilation=9).cuda()
    with torch.inference_mode():
        for num_in in (54 + 400, 54 + 401, 54 + 400):
            x = torch.randn(4, 64, num_in, device="cuda")
            got = choice(x, conv)
            assert (got - conv(x)).abs().max().item() < 1e-4
    assert len(choice.decisions) == 2 and len(choice.timings_ms) == 2  # the repeated shape was not timed again
    assert all(direct > 0 and phased > 0 for direct, phased in choice.timings_ms.values())
