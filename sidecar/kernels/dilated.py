"""A dilated convolution as one undilated conv over its input's phases (one of ``ConvChoice``'s forms).

cuDNN's heuristics sometimes pick a kernel that does not use tensor cores for a dilated conv: on the H200 (bf16)
the default model's residual unit ``Conv1d(384, 384, 7, dilation=9)`` at ``[16, 384, 4054]`` takes 4.7 ms where its
``dilation=3`` sibling at almost the same shape takes 0.50 ms (18.3 against 1.8 ms at batch 64), and at batch 1
the 192-channel ``dilation=3`` and ``9`` convs take 0.56 ms against 0.11 ms undilated
(docs/design-notes.md, "The convolutions"). Which shapes are hit depends on cuDNN's version and the GPU, so no rule is
written down here; instead:

- ``polyphase_conv`` computes the same conv as one *undilated* conv: with dilation ``d``,
  ``y[r + d m] = sum_k W_k x[r + d (m + k)]``, so the ``d`` interleaved phases of ``x`` stacked on the batch
  (``[B * d, C, L / d]``) go through the conv with dilation 1 and the output phases are interleaved back. It costs
  two copies (phases in, audio order out), so it is slower where cuDNN is fine.
- ``conv_choice.ConvChoice`` times it against cuDNN (and the implicit-GEMM kernel of ``conv_gemm.py``) once per
  input shape and keeps the fastest.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


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
