"""Dilated convs as one undilated conv over their phases (``sidecar/kernels/dilated.py``), and the measured choice.

CPU: ``polyphase_conv`` equals ``F.conv1d`` with the dilation for lengths that the dilation divides and that it
does not, grouped convs and a single output column; the choice leaves CPU tensors to the conv as it is. CUDA: the
choice times both forms once per shape and keeps the result, and whichever it picks gives the conv's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
    conv = torch.nn.Conv1d(4, 4, 7, dilation=3)
    x = torch.randn(2, 4, 40)
    assert torch.equal(choice(x, conv), conv(x))
    assert choice.decisions == {}  # nothing measured on the CPU


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
