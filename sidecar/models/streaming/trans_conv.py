"""``CausalTransConv``: a ``ConvTranspose1d`` (kernel ``k``, stride ``s``) cut to ``T * s`` samples per ``T`` inputs.

Output frame ``t`` (samples ``t s .. t s + s - 1``) depends on inputs ``t - P .. t`` with ``P = ceil(k / s) - 1``;
those ``P`` input columns (after the activation applied before it) are the state, and the last ``k - s`` samples of
the full transposed conv are dropped (the next chunk's state adds them). The weights sit in an
``nn.ConvTranspose1d`` named ``conv``. Forms:

- kernel ``2s`` (the decoder blocks'), the activation before it fused: the activation writes frame pairs and the
  conv is one GEMM (``kernels.transposed.SnakeThenTransposedConv``), output channels-last;
- kernel ``2s`` otherwise, the "add" form: transpose-convolve ``x`` alone, add the previous frame's share
  (``prev @ W[:, :, s:]``, no second bias) into the first ``s`` samples and drop the last ``s`` (half the extra
  work of running over ``[prev, x]``; with a zero state the one-shot computation bit for bit);
- kernel ``s`` (an upsampling stage, no state): one ``F.linear`` where ``derived.kernel_forms()``
  (``kernels.transposed.FrameTransposedConv``), output channels-last;
- any other kernel: the transposed conv over ``[state, x]``, its first ``P s`` and last ``k - s`` samples dropped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels import transposed
from ...kernels.derived import kernel_forms
from ...kernels.snake import cat_with_tail
from .activation import StreamActivation, activated_join
from .base import StatefulBlock, StreamContext


class CausalTransConv(StatefulBlock):
    """Causal ``ConvTranspose1d(C_in, C_out, k, stride s)`` (``.conv``): ``T`` inputs give ``T * s`` samples."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.num_state_cols = math.ceil(kernel_size / stride) - 1
        # kernel 2s: the activation's frame pairs and one GEMM, where the activation runs fused
        self.pairs = transposed.SnakeThenTransposedConv(stride) if kernel_size == 2 * stride else None
        # kernel s: one GEMM where autograd is off and torch.compile is not tracing (no state, no activation)
        self.frames = transposed.FrameTransposedConv(stride) if kernel_size == stride else None

    def state_shape(self) -> tuple[int, ...] | None:
        return (self.conv.in_channels, self.num_state_cols) if self.num_state_cols else None

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext, act: StreamActivation | None = None,
                in_bias: Tensor | None = None, bias_later: bool = False) -> tuple[Tensor, Tensor]:
        """``x`` ``[B, C_in, T]`` -> ``(y [B, C_out, T s], lengths * s)``. ``act``: the activation before this
        conv, applied here; ``in_bias`` (fused ``act`` only), ``bias_later``: as for ``CausalConv`` (here any form
        can leave its bias out)."""
        s = self.stride
        bias = None if bias_later else self.conv.bias
        if self.pairs is not None and act is not None and act.runs_fused(x):
            alpha, beta, log_params = act.kernel_params()
            y, tail = self.pairs(x, ctx.state_in[self.state_key], alpha, beta, lengths, log_params, self.conv.weight,
                                 bias, in_bias)  # [B, C_out, T s] channels-last
            ctx.state_out[self.state_key] = tail  # [B, C_in, 1]
            return y, lengths * s
        if self.frames is not None and act is None and in_bias is None and kernel_forms():
            return self.frames(x, self.conv.weight, bias), lengths * s  # [B, C_out, T s] channels-last
        if self.pairs is not None:
            return self._add_form(x, lengths, ctx, act, in_bias, bias), lengths * s  # [B, C_out, T s]
        num_in, num_prev = x.shape[2], self.num_state_cols
        x_cat = activated_join(act, x, lengths, ctx, self.state_key, num_prev, in_bias)  # [B, C_in, P + T]
        y = F.conv_transpose1d(x_cat, self.conv.weight, bias, stride=s)  # [B, C_out, (P + T - 1) s + k]
        start = num_prev * s
        return y[:, :, start:start + num_in * s], lengths * s  # [B, C_out, T s]

    def _add_form(self, x: Tensor, lengths: Tensor, ctx: StreamContext, act: StreamActivation | None,
                  in_bias: Tensor | None, bias: Tensor | None) -> Tensor:
        """Kernel ``2s`` without the fused activation (the module docstring's "add" form): ``[B, C_out, T s]``."""
        if in_bias is not None:
            raise ValueError("in_bias needs the fused kernel (act.runs_fused(x))")
        s, num_in = self.stride, x.shape[2]
        weight = self.conv.weight  # [C_in, C_out, 2s]
        if act is not None:
            x, _ = act(x, lengths, ctx)  # [B, C_in, T]
        prev = ctx.state_in[self.state_key].to(x.dtype)  # [B, C_in, 1]
        _, ctx.state_out[self.state_key] = cat_with_tail(x, prev, lengths)  # [B, C_in, 1]: the last valid frame
        y = F.conv_transpose1d(x, weight, bias, stride=s)[:, :, :num_in * s]  # [B, C_out, T s]
        carry = torch.einsum("bc,cok->bok", prev[:, :, 0], weight[:, :, s:])  # [B, C_out, s]
        head = y[:, :, :s] + carry  # [B, C_out, s]
        return torch.cat([head, y[:, :, s:]], dim=2)  # [B, C_out, T s]
