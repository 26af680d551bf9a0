"""Dilated convolutions two ways, and the faster one per input shape, measured once on the device.

cuDNN's heuristics sometimes pick a kernel that does not use tensor cores for a dilated conv: on the H200 (bf16)
the default model's residual unit ``Conv1d(384, 384, 7, dilation=9)`` at ``[16, 384, 4054]`` takes 4.7 ms where its
``dilation=3`` sibling at almost the same shape takes 0.50 ms (18.3 against 1.8 ms at batch 64), and at batch 1
the 192-channel ``dilation=3`` and ``9`` convs take 0.56 ms against 0.11 ms undilated
(``loadgen/probes/conv_shapes.py``). Which shapes are hit depends on cuDNN's version and the GPU, so no rule is
written down here; instead:

- ``polyphase_conv`` computes the same conv as one *undilated* conv: with dilation ``d``,
  ``y[r + d m] = sum_k W_k x[r + d (m + k)]``, so the ``d`` interleaved phases of ``x`` stacked on the batch
  (``[B * d, C, L / d]``) go through the conv with dilation 1 and the output phases are interleaved back. It costs
  two copies (phases in, audio order out), so it is slower where cuDNN is fine.
- ``DilatedConvChoice`` times both once per input shape (CUDA events, outside stream capture; graph buckets are
  warmed up eagerly before capture, so their shapes are measured then and captured in the chosen form) and keeps
  the faster. CPU tensors, shapes first seen during a capture, ``torch.compile`` tracing, convs with padding or a
  stride, and shapes past ``MAX_MEASURED_SHAPES`` (eager steps of ever new shapes) use the conv as it is. A new
  shape costs its first step a few milliseconds (eight calls of the conv), tens at batch 64.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

TIMED_ITERS = 3
"""Timed calls per formulation (after one untimed): the minimum is kept."""
MAX_MEASURED_SHAPES = 32
"""Shapes measured per conv; later new shapes (eager steps only: graph buckets are measured at start-up) keep cuDNN."""


def polyphase_conv(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, groups: int = 1) -> Tensor:
    """``F.conv1d(x, weight, bias, dilation=dilation, groups=groups)`` (no padding) as one undilated conv over the
    ``dilation`` phases of ``x`` ``[B, C, L]``. Returns ``[B, C_out, L - (k - 1) * dilation]``."""
    d = dilation
    batch, channels, num_in = x.shape
    num_out = num_in - (weight.shape[2] - 1) * d
    num_phase_cols = -(-num_in // d)  # columns per phase; the last phases are one short when d does not divide L
    phases = x.new_empty((batch, d, channels, num_phase_cols))  # [B, d, C, M]
    full = num_in // d
    # phases[b, r, c, m] = x[b, c, m * d + r]; the columns past L (at most d - 1) only reach outputs past num_out
    phases[:, :, :, :full].copy_(x[:, :, :full * d].view(batch, channels, full, d).permute(0, 3, 1, 2))
    if full < num_phase_cols:
        rest = num_in - full * d
        phases[:, :rest, :, full].copy_(x[:, :, full * d:].permute(0, 2, 1))
        phases[:, rest:, :, full].zero_()
    y = F.conv1d(phases.view(batch * d, channels, num_phase_cols), weight, bias, groups=groups)  # [B*d, C_out, M']
    out_channels = y.shape[1]
    y = y.view(batch, d, out_channels, -1).permute(0, 2, 3, 1).reshape(batch, out_channels, -1)  # [B, C_out, M'*d]
    return y[:, :, :num_out]  # [B, C_out, T]


def _min_ms(fn, x: Tensor) -> float:
    """Minimum device time of ``fn(x)`` on ``x``'s device and its current stream (call it under
    ``torch.cuda.device(x.device)``)."""
    fn(x)
    times = []
    for _ in range(TIMED_ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


class DilatedConvChoice:
    """For one dilated conv module: whether each input shape runs as ``polyphase_conv``, measured on first sight.

    ``decisions`` maps ``(batch, channels, length, dtype)`` to True (polyphase) or False (the conv as it is);
    ``timings_ms`` keeps both measurements for logs and probes."""

    def __init__(self) -> None:
        self.decisions: dict[tuple, bool] = {}
        self.timings_ms: dict[tuple, tuple[float, float]] = {}

    def __call__(self, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool = True) -> Tensor:
        """``conv(x)`` (without its bias when ``with_bias`` is False: a caller that adds it later)."""
        d = conv.dilation[0]
        bias = conv.bias if with_bias else None
        if d == 1 or not x.is_cuda or torch.compiler.is_compiling() or not _plain(conv):
            return conv._conv_forward(x, conv.weight, bias)  # the module's own call (padding modes included)
        key = (*x.shape, x.dtype, x.device)
        use_phases = self.decisions.get(key)
        if use_phases is None:
            if torch.cuda.is_current_stream_capturing() or len(self.decisions) >= MAX_MEASURED_SHAPES:
                use_phases = False  # not timed inside a capture, nor past the cap: the conv as it is
            else:
                use_phases = self.measure(x, conv)
        if use_phases:
            return polyphase_conv(x, conv.weight, bias, d, conv.groups)  # [B, C_out, T]
        return F.conv1d(x, conv.weight, bias, dilation=d, groups=conv.groups)  # [B, C_out, T]

    def measure(self, x: Tensor, conv: torch.nn.Conv1d) -> bool:
        key = (*x.shape, x.dtype, x.device)
        with torch.cuda.device(x.device):  # events on x's device (a server may run on cuda:N)
            direct = _min_ms(conv, x)
            phased = _min_ms(lambda t: polyphase_conv(t, conv.weight, conv.bias, conv.dilation[0], conv.groups), x)
        self.timings_ms[key] = (direct, phased)
        self.decisions[key] = phased < direct
        log.debug("dilated conv %s: cuDNN %.3f ms, polyphase %.3f ms", tuple(x.shape), direct, phased)
        return self.decisions[key]


def _plain(conv: torch.nn.Conv1d) -> bool:
    """What ``polyphase_conv`` computes: stride 1, no padding (the causal convs pad with their state instead)."""
    return conv.stride == (1,) and conv.padding in ((0,), "valid") and conv.padding_mode == "zeros"
