"""Convolutional building blocks of the Qwen3-TTS 12 Hz decoder, written for streaming.

Each block's ``forward(x, lengths, ctx)`` takes ``x`` ``[B, C, T]`` and the per-row valid lengths ``[B]``
and returns ``(y, lengths_out)``. With a zero state the result equals the block's stateless (left
zero-padded) definition; with a carried state it continues a stream exactly. Parameter names match the
checkpoint (``.conv``, ``alpha``, ``beta``, ``dwconv``, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels import snake_conv as _registers_snake_conv_out  # noqa: F401  (torch.ops.code2wav.snake_conv_out)
from ...kernels import conv_gemm as _registers_conv_snake  # noqa: F401  (torch.ops.code2wav.conv_snake)
from ...kernels import depthwise as _registers_depthwise  # noqa: F401  (torch.ops.code2wav.depthwise_snake)
from ...kernels import state_cat  # (registers torch.ops.code2wav.state_cat)
from ...kernels import matmul_choice, transposed
from ...kernels.conv_choice import ConvChoice
from ...kernels.derived import kernel_forms
from ...kernels import snake as _registers_snake_cat  # noqa: F401  (torch.ops.code2wav.snake_cat*)
from ...kernels.pending import BiasSum, folds_biases, run_chain
from .streaming import StatefulBlock, StreamCtx


def _activated_cat(act: "SnakeBeta | None", x: Tensor, lengths: Tensor, ctx: StreamCtx, key: str,
                   num_state_cols: int, in_bias: Tensor | None = None, channels_last: bool = False,
                   cat_op: bool = False) -> Tensor:
    """``[state, act(x)]`` ``[B, C, P + T]`` (just ``act(x)`` without state), the new state tail written to
    ``ctx.state_out[key]``: one fused kernel (``kernels/snake.py``) when ``act`` runs fused, else torch ops.

    Only where ``act`` runs fused: ``in_bias`` ``[C]`` is the sum of the biases still pending on ``x``
    (``pending.run_chain``: a conv's bias left out of it, since PyTorch adds a cuDNN conv's bias in a full pass of
    its own, and the residual units' 1x1 biases), added before the activation; ``channels_last``: the result with
    its channels contiguous (fused only; the conv's form reads it so). ``cat_op``: where ``act`` does not run
    fused, the join and the tail as one op (``state_cat.join``; the caller's ``kernels_on``)."""
    if act is not None and act.runs_fused(x):
        state = ctx.state_in[key] if num_state_cols else None
        x_cat, tail = torch.ops.code2wav.snake_cat(x, state, act.alpha, act.beta, lengths, True,
                                                   in_bias, channels_last)  # [B, C, P + T]
        if num_state_cols:
            ctx.state_out[key] = tail  # [B, C, P]
        return x_cat
    if in_bias is not None:
        raise ValueError("in_bias needs the fused kernel (act.runs_fused(x))")
    if act is not None:
        x, _ = act(x, lengths, ctx)  # [B, C, T]
    if not num_state_cols:
        return x
    x_cat, ctx.state_out[key] = state_cat.join(x, ctx.state_in[key], lengths, op=cat_op)  # [B, C, P + T], [B, C, P]
    return x_cat


class CausalConv(StatefulBlock):
    """Stride-1 causal ``Conv1d`` (``.conv``): keeps the last ``(k-1)*d`` input columns as state."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.num_state_cols = (kernel_size - 1) * dilation
        # the last layer (one output channel): Snake and the conv in one kernel (``kernels/snake_conv.py``)
        self.one_output = out_channels == 1 and dilation == 1 and groups == 1 and kernel_size > 1
        # dense k > 1: cuDNN, the polyphase form (dilated) or the implicit-GEMM kernel, whichever measured fastest
        # per shape (``kernels/conv_choice.py``)
        self.choice = ConvChoice() if groups == 1 and kernel_size > 1 and not self.one_output else None
        # depthwise (the ConvNeXt stage's): ``kernels/depthwise.py``'s kernel on CUDA where the family switched its
        # kernels on (``kernels_on``, set by ``conv_choice.switch_kernels``), else cuDNN; where no fused Snake
        # joins its state, the state join and tail as one op then (``kernels/state_cat.py``)
        self.depthwise = groups > 1 and groups == in_channels == out_channels
        self.kernels_on = False

    def state_shape(self) -> tuple[int, ...] | None:
        return (self.conv.in_channels, self.num_state_cols) if self.num_state_cols else None

    def runs_depthwise_kernel(self, x: Tensor) -> bool:
        return self.depthwise and self.kernels_on and x.is_cuda and not torch.compiler.is_compiling()

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx, act: "SnakeBeta | None" = None,
                in_bias: Tensor | None = None, bias_later: bool = False,
                then_act: "SnakeBeta | None" = None) -> tuple[Tensor, Tensor]:
        """``act``: the activation before this conv, applied here (fused with the state concatenation);
        ``in_bias``: see ``_activated_cat``; ``bias_later``: the output without this conv's bias (the caller
        hands it on as pending, ``pending.run_chain``); ``then_act`` (only where ``folds_biases``, on a conv with a
        ``choice``): return ``then_act(conv(x) + bias)``, in the conv's epilogue where the chosen form has one."""
        if self.one_output and act is not None and act.runs_fused(x):
            y, tail = torch.ops.code2wav.snake_conv_out(x, ctx.state_in[self.state_key], act.alpha, act.beta,
                                                        lengths, True, self.conv.weight, self.conv.bias,
                                                        in_bias)  # [B, 1, T]
            ctx.state_out[self.state_key] = tail  # [B, C, P]
            return y, lengths
        fused = act is not None and act.runs_fused(x)  # x_cat comes from a Snake kernel: either layout, same cost
        cat_shape = (x.shape[0], x.shape[1], self.num_state_cols + x.shape[2])
        channels_last = fused and self.choice is not None and self.choice.wants_channels_last(
            cat_shape, x.dtype, x.device, then_act is not None)
        x_cat = _activated_cat(act, x, lengths, ctx, self.state_key, self.num_state_cols,
                               in_bias, channels_last, cat_op=self.kernels_on)  # [B, C, P + T]
        if self.choice is None:
            if then_act is not None or bias_later:
                raise ValueError("then_act and bias_later need a conv with a ConvChoice (dense, k > 1)")
            if self.runs_depthwise_kernel(x_cat):
                return torch.ops.code2wav.depthwise_snake(x_cat, self.conv.weight, self.conv.bias,
                                                          self.conv.dilation[0], None, None, False), lengths
            return self.conv(x_cat), lengths  # [B, C_out, T]
        if then_act is not None:
            params = (then_act.alpha, then_act.beta, True)
            return self.choice(x_cat, self.conv, act=params,
                               channels_last_ok=fused), lengths  # [B, C_out, T], activated
        return self.choice(x_cat, self.conv, with_bias=not bias_later,
                           channels_last_ok=fused), lengths  # [B, C_out, T]


class CausalTransConv(StatefulBlock):
    """``ConvTranspose1d(k, stride s)`` (``.conv``) with the last ``k - s`` samples dropped.

    Output block ``t`` depends on inputs ``t - P .. t`` with ``P = ceil(k / s) - 1``; those ``P`` input
    columns are the state. ``T`` inputs give ``T * s`` samples. With ``k = 2s`` (the decoder blocks) and the Snake
    before it fused, the Snake writes frame pairs and the conv is one GEMM (``kernels/transposed.py``); with
    ``k = s`` (the upsampling stage) the conv is one ``F.linear`` on every device where autograd is off and
    ``torch.compile`` is not tracing. Either output is channels-last.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.num_state_cols = math.ceil(kernel_size / stride) - 1
        # kernel 2s (the decoder blocks): the Snake's frame pairs and one GEMM, where the Snake runs fused
        self.pairs = transposed.SnakeThenTransposedConv(stride) if kernel_size == 2 * stride else None
        # kernel s (the upsampling stage): one GEMM everywhere (no state, no Snake before it)
        self.frames = transposed.FrameTransposedConv(stride) if kernel_size == stride else None

    def state_shape(self) -> tuple[int, ...] | None:
        return (self.conv.in_channels, self.num_state_cols) if self.num_state_cols else None

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx, act: "SnakeBeta | None" = None,
                in_bias: Tensor | None = None, bias_later: bool = False) -> tuple[Tensor, Tensor]:
        """``act``: the activation before this conv, applied here (fused with the state concatenation);
        ``in_bias``, ``bias_later``: as for ``CausalConv``."""
        num_in = x.shape[2]
        num_prev = self.num_state_cols
        if self.pairs is not None and act is not None and act.runs_fused(x):
            y, tail = self.pairs(x, ctx.state_in[self.state_key], act.alpha, act.beta, lengths, True, self.conv.weight,
                                 None if bias_later else self.conv.bias, in_bias)  # [B, C_out, T * s] channels-last
            ctx.state_out[self.state_key] = tail  # [B, C_in, 1]
            return y, lengths * self.stride
        if self.frames is not None and act is None and in_bias is None and kernel_forms():
            y = self.frames(x, self.conv.weight, None if bias_later else self.conv.bias)  # [B, C_out, T s] (CL)
            return y, lengths * self.stride
        x = _activated_cat(act, x, lengths, ctx, self.state_key, num_prev, in_bias=in_bias)  # [B, C, P + T]
        y = self.conv(x) if not bias_later else F.conv_transpose1d(
            x, self.conv.weight, None, stride=self.stride)  # [B, C_out, (P + T - 1) * s + k]
        start = num_prev * self.stride
        return y[:, :, start:start + num_in * self.stride], lengths * self.stride  # [B, C_out, T * s]


class SnakeBeta(nn.Module):
    """``x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2`` per channel; stateless.

    ``fused`` (set by ``Qwen3TTSDecoder.use_fused_kernels``): the conv after it applies it with the Triton kernel
    ``code2wav::snake_cat`` (``code2wav::snake_conv_out`` before the last, one-channel conv) on CUDA tensors,
    except while ``torch.compile`` traces (Inductor fuses the torch expression below with its neighbours itself)."""

    fused = False

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def runs_fused(self, x: Tensor) -> bool:
        return self.fused and x.is_cuda and not torch.compiler.is_compiling()

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx) -> tuple[Tensor, Tensor]:
        alpha = torch.exp(self.alpha)[None, :, None]  # [1, C, 1]
        inv_beta = 1.0 / (torch.exp(self.beta)[None, :, None] + 1e-9)  # [1, C, 1]
        # One temporary instead of four: these tensors are the largest of the decoder (graph memory).
        out = torch.mul(x, alpha)  # [B, C, T]
        return out.sin_().square_().mul_(inv_beta).add_(x), lengths


class ConvNeXt(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm(eps 1e-6) -> Linear 4x -> GELU -> Linear -> * gamma -> + x."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx) -> tuple[Tensor, Tensor]:
        h, _ = self.dwconv(x, lengths, ctx)  # [B, C, T]
        h = self.norm(h.transpose(1, 2))  # [B, T, C]
        h = self.pwconv2(F.gelu(self.pwconv1(h))) * self.gamma  # [B, T, C]
        return x + h.transpose(1, 2), lengths  # [B, C, T]


class ResidualUnit(nn.Module):
    """``x + conv2(act2(conv1(act1(x))))`` with ``conv1`` causal k7 dilation ``d`` and ``conv2`` k1.

    ``conv2`` and the residual add run as one batched matmul, ``x + W @ act2(h)`` (``baddbmm``: the residual is
    read in the GEMM's epilogue), written over ``x``: the unit consumes its input (out of place under
    ``torch.compile`` and autograd). ``conv2`` stays a module for its checkpoint names; its ``forward`` is not
    called. On the H200 (bf16, batch 16 x 25 frames) the six 1x1 convs of a step take 1.59 ms that way with the
    adds included, against 2.51 ms as cuDNN convs before the adds. Where ``act1`` runs fused (``folds_biases``),
    ``conv2``'s bias is not added to ``x`` at all: it joins the pending biases the unit passes on
    (``pending.run_chain``), and the next kernel that reads the stream adds their sum. Adding it here took a full
    read and write of the unit's input: PyTorch's ``add`` on a strided tensor was the top kernel of the batch-16
    profile (3.73 ms); written back by the Snake kernel in the same pass, that kernel still reached half the
    bandwidth of the plain ``snake_cat`` (docs/performance.md). In float32 on a channels-last stream the GEMM is
    ``matmul_choice.residual_matmul_``'s (cuBLAS or the 3xTF32 kernel over ``[B T, C]`` rows, whichever measured
    faster)."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)
        self.matmul_choice = matmul_choice.MatmulChoice()  # conv2's GEMM form in place (float32: 3xTF32 or cuBLAS)
        self.in_bias = BiasSum()  # the pending biases' sum, added by act1's kernel

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx,
                pending: tuple[Tensor, ...] = ()) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """``pending``: biases that belong to ``x`` but are not in it (only where ``folds_biases``;
        ``pending.run_chain``). Returns ``(x, lengths, pending)``."""
        conv = self.conv2.conv
        # in place: x (the previous layer's output, used by nobody after this unit) becomes the output, so the
        # step's largest activations are not allocated twice (graph pool memory). Dynamo refuses a strided out=
        # (Inductor plans the memory itself), and autograd any out=: there the same sum runs out of place.
        in_place = kernel_forms()
        if folds_biases(self.act1, x):  # implies in_place: act2(conv1(act1(x + pending))), conv2's bias pending
            h, _ = self.conv1(x, lengths, ctx, act=self.act1, in_bias=self.in_bias(pending),
                              then_act=self.act2)  # [B, C, T]
            x = matmul_choice.residual_matmul_(x, conv.weight[:, :, 0], h, self.matmul_choice)  # [B, C, T]
            return x, lengths, (*pending, conv.bias)
        if pending:  # its skip path would need them too: only the fused form carries them on
            raise ValueError("pending biases need the fused form (folds_biases, autograd off)")
        h, _ = self.conv1(x, lengths, ctx, act=self.act1)  # [B, C, T]
        h = _activated_cat(self.act2, h, lengths, ctx, self.conv2.state_key, 0)  # [B, C, T] (k1: no state)
        if not in_place:
            weight = conv.weight[:, :, 0].expand(h.shape[0], -1, -1)  # [B, C, C] (stride 0 over the batch)
            return torch.baddbmm(x + conv.bias[None, :, None], weight, h), lengths, ()  # [B, C, T]
        x.add_(conv.bias[None, :, None])  # [B, C, T]
        return matmul_choice.residual_matmul_(x, conv.weight[:, :, 0], h, self.matmul_choice), lengths, ()


class StreamSequential(nn.ModuleList):
    """Runs its blocks in order, threading ``(x, lengths)`` through. Indexed names like ``block.0``."""

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        for module in self:
            x, lengths = module(x, lengths, ctx)
        return x, lengths


class DecoderBlock(nn.Module):
    """``block = [SnakeBeta, CausalTransConv(2r, r), ResidualUnit d=1, d=3, d=9]``."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = StreamSequential([
            SnakeBeta(in_dim),
            CausalTransConv(in_dim, out_dim, 2 * rate, rate),
            ResidualUnit(out_dim, 1),
            ResidualUnit(out_dim, 3),
            ResidualUnit(out_dim, 9),
        ])
        self.in_bias = BiasSum()  # the previous block's pending biases' sum, added by the Snake before upsampling

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx,
                pending: tuple[Tensor, ...] = ()) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """``pending``: biases still to add to ``x`` (only where ``folds_biases``; ``pending.run_chain``). Returns
        ``(x, lengths, pending)``: the upsampling conv's bias and the units' 1x1 biases stay pending."""
        act, upsample, *units = self.block
        fold = folds_biases(act, x)
        x, lengths = upsample(x, lengths, ctx, act=act, in_bias=self.in_bias(pending),
                              bias_later=fold)  # [B, C_out, T * r]
        return run_chain(units, x, lengths, ctx, (upsample.conv.bias,) if fold else ())  # [B, C_out, T * r]
