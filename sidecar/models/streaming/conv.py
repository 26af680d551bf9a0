"""``CausalConv``: a stride-1 causal ``Conv1d`` that carries its last ``(k - 1) * d`` input columns as state.

One class for every conv of both families: dense (its form chosen per shape by ``kernels.conv_choice.ConvChoice``),
dilated, grouped or depthwise, and the one-output last layer. The weights sit in an ``nn.Conv1d`` named ``conv``
(parameter names ``<block>.conv.weight``, ``<block>.conv.bias``: ``names.flat_conv_names`` maps them to a
checkpoint that stores them one level up). With a zero state the output equals ``F.conv1d`` over the input
left-padded with ``(k - 1) * d`` zeros; with a carried state it continues a stream exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...kernels import depthwise, snake_conv
from ...kernels.conv_choice import ConvChoice, epilogue
from ...kernels.conv_forms import Residual
from .activation import StreamActivation, activated_join
from .base import StatefulBlock, StreamContext

CALLED_OPS = (snake_conv.snake_conv_out, depthwise.depthwise_snake)
"""The kernel ops ``CausalConv`` calls as ``torch.ops.code2wav.*`` (importing their modules registers them; the
choice's own, ``conv_snake``, come with ``conv_choice``)."""


class CausalConv(StatefulBlock):
    """Stride-1 causal ``Conv1d`` (``.conv``); its state is the last ``(k - 1) * d`` input columns (after the
    activation applied before it)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.num_state_cols = (kernel_size - 1) * dilation
        # the last layer (one output channel): the activation and the conv in one op (``kernels/snake_conv.py``)
        self.one_output = out_channels == 1 and dilation == 1 and groups == 1 and kernel_size > 1
        # dense k > 1: cuDNN, cuDNN channels-last, the polyphase form (dilated) or the implicit-GEMM kernel, whichever
        # measured fastest per shape (``kernels/conv_choice.py``)
        self.choice = ConvChoice() if groups == 1 and kernel_size > 1 and not self.one_output else None
        # depthwise: ``kernels/depthwise.py``'s op on CUDA where the family switched its kernels on (``kernels_on``,
        # set by ``conv_choice.switch_kernels``), shifted multiply-adds under ``torch.compile``, else cuDNN
        self.depthwise = groups > 1 and groups == in_channels == out_channels
        # also: where no fused activation joins the state, the join and tail as one op (``kernels/state_cat.py``)
        self.kernels_on = False

    def state_shape(self) -> tuple[int, ...] | None:
        return (self.conv.in_channels, self.num_state_cols) if self.num_state_cols else None

    def runs_depthwise_kernel(self, x: Tensor) -> bool:
        return self.depthwise and self.kernels_on and x.is_cuda and not torch.compiler.is_compiling()

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext, act: StreamActivation | None = None,
                in_bias: Tensor | None = None, bias_later: bool = False,
                then_act: StreamActivation | None = None, then_residual: Residual | None = None
                ) -> tuple[Tensor, Tensor]:
        """``x`` ``[B, C_in, T]`` -> ``(y [B, C_out, T], lengths)``. ``act``: the activation before this conv,
        applied here (fused with the state join where it runs fused); ``in_bias`` ``[C_in]`` (fused ``act`` only):
        biases still pending on ``x`` (``pending.run_chain``), added before ``act``; ``bias_later`` (a conv with a
        ``choice``): the output without this conv's bias (the caller hands it on as pending); ``then_act``: return
        ``then_act(conv(x) + bias)``, in the conv's epilogue where its form has one (the GEMM kernel, the depthwise
        kernel; the other forms of a ``choice`` then run the Snake kernel with the bias as its ``in_bias``);
        ``then_residual`` (with ``then_act``, a conv with a ``choice``: a residual unit's conv1): return the unit's
        stream updated in place, ``x + W2 @ then_act(conv(x) + bias)`` (``conv_forms.Residual``), in one kernel
        where the form measured fastest is one."""
        conv = self.conv
        fused = act is not None and act.runs_fused(x)  # x_cat comes from a Snake kernel: either layout, same cost
        if fused and self.one_output:
            alpha, beta, log_params = act.kernel_params()
            y, tail = torch.ops.code2wav.snake_conv_out(x, ctx.state_in[self.state_key], alpha, beta, lengths,
                                                        log_params, conv.weight, conv.bias, in_bias)  # [B, 1, T]
            ctx.state_out[self.state_key] = tail  # [B, C, P]
            return y, lengths
        if then_residual is not None and (self.choice is None or then_act is None):
            raise ValueError("then_residual needs a conv with a ConvChoice and then_act")
        channels_last = fused and self._wants_channels_last(x, epilogue(then_act, then_residual))
        x_cat = activated_join(act, x, lengths, ctx, self.state_key, self.num_state_cols, in_bias, channels_last,
                               join_op=self.kernels_on)  # [B, C_in, P + T]
        if self.choice is not None:
            if then_act is not None:
                return self.choice(x_cat, conv, act=then_act.kernel_params(), channels_last_ok=fused,
                                   residual=then_residual), lengths  # [B, C_out, T], activated (or the stream)
            return self.choice(x_cat, conv, with_bias=not bias_later, channels_last_ok=fused), lengths  # [B, C_out, T]
        if bias_later:
            raise ValueError("bias_later needs a conv with a ConvChoice (dense, k > 1)")
        if self.runs_depthwise_kernel(x_cat):
            alpha, beta, log_params = then_act.kernel_params() if then_act is not None else (None, None, False)
            return torch.ops.code2wav.depthwise_snake(x_cat, conv.weight, conv.bias, conv.dilation[0], alpha, beta,
                                                      log_params), lengths  # [B, C, T], laid out as x_cat
        if self.depthwise and torch.compiler.is_compiling():
            y = depthwise.shifted_taps(x_cat, conv.weight, conv.bias, conv.dilation[0])  # [B, C, T], fused by Inductor
        else:
            y = conv(x_cat)  # [B, C_out, T]
        if then_act is not None:
            y, _ = then_act(y, lengths, ctx)  # [B, C_out, T]
        return y, lengths

    def _wants_channels_last(self, x: Tensor, with_act: int) -> bool:
        """Whether the fused activation writes ``x_cat`` channels-last: where the conv's measured form reads it so,
        and for a depthwise conv where ``x`` is (a channels-last residual stream stays channels-last: the cat, the
        depthwise op's output, the GEMM's operand after it)."""
        if self.choice is not None:
            shape = (x.shape[0], x.shape[1], self.num_state_cols + x.shape[2])
            return self.choice.wants_channels_last(shape, x.dtype, x.device, with_act)
        return self.depthwise and depthwise.channels_last(x)
