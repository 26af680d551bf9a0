"""Blocks of the VoxCPM2 AudioVAE decoder, composed of the streaming kit's causal convs (``models/streaming``).

Every block's ``forward(x, lengths, ctx)`` takes ``x`` ``[B, C, T]`` and per-row valid lengths ``[B]`` (columns
past a row's length are right padding) and returns ``(y, lengths_out)`` (the residual units and decoder blocks also
thread pending biases, ``pending.run_chain``). Weights are plain, already folded tensors (weight norm is folded at
load time); parameter names are the checkpoint's after folding with the kit convs' ``.conv`` level added
(``model.0.conv.weight`` for the file's ``model.0.weight``: ``streaming.flat_conv_names``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels import matmul_choice
from ...kernels.derived import DerivedTensor, kernel_forms
from ...kernels.pending import BiasSum, float_sum, folds_biases, run_chain
from ..streaming import CausalConv, CausalTransConv, StreamActivation, StreamContext, StreamSequential


class Snake(StreamActivation):
    """``x + sin(alpha * x)**2 / (alpha + 1e-9)`` with ``alpha`` ``[1, C, 1]`` used as stored (no exp, no beta: the
    Snake kernels get ``alpha`` twice, ``log_params`` False).

    ``fused`` (set by ``VoxCPM2AudioVAEDecoder.use_fused_kernels``): the conv next to it applies it with the Triton
    kernels (``code2wav::snake_cat``, ``::snake_pairs``, ``::depthwise_snake``, ``::snake_conv_out``) on CUDA
    tensors, except while ``torch.compile`` traces."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def kernel_params(self) -> tuple[Tensor, Tensor, bool]:
        alpha = self.alpha.view(-1)  # [C]
        return alpha, alpha, False

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext) -> tuple[Tensor, Tensor]:
        # 5 kernels, one temporary: the divide and the residual add fused (addcdiv, written over the temporary), and
        # no per-call reciprocal of alpha (was 7 kernels)
        out = torch.mul(self.alpha, x).sin_().square_()  # [B, C, T]
        return torch.addcdiv(x, out, self.alpha + 1e-9, out=out), lengths  # x + sin^2(alpha x) / (alpha + 1e-9)


class ScaleBias(nn.Module):
    """Sample-rate conditioning: ``x * scale_embed[b] + bias_embed[b]`` per row ``b``'s bucket, per channel.

    Where ``derived.kernel_forms()`` (the sidecar's steps), both tables are looked up as
    one (``[buckets, 2C]``, made once: ``kernels/derived.py``): one kernel fewer per block at batch 1. Biases left
    pending on ``x`` by the block before (``pending.run_chain``) fold into that table, since ``(x + p) * s + b = x *
    s + (p * s + b)`` per bucket: the blocks' residual streams never take a pass of their own to add a bias."""

    def __init__(self, num_buckets: int, channels: int) -> None:
        super().__init__()
        self.scale_embed = nn.Embedding(num_buckets, channels)
        self.bias_embed = nn.Embedding(num_buckets, channels)
        self._tables: DerivedTensor[Tensor] = DerivedTensor()

    def forward(self, x: Tensor, sr_bucket: Tensor, pending: tuple[Tensor, ...] = ()) -> Tensor:
        """``pending``: per-channel biases ``[C]`` that belong to ``x`` but were not added to it (only in the kernel
        forms); folded into the bias table."""
        if kernel_forms():
            sources = [self.scale_embed.weight, self.bias_embed.weight, *pending]
            table = self._tables.get(sources, lambda: self._table(pending))  # [K, 2C]
            scale, bias = F.embedding(sr_bucket, table)[:, :, None].chunk(2, dim=1)  # [B, C, 1] each
        elif pending:
            raise ValueError("pending biases need the kernel forms (no autograd, not under torch.compile)")
        else:
            scale = self.scale_embed(sr_bucket)[:, :, None]  # [B, C, 1]
            bias = self.bias_embed(sr_bucket)[:, :, None]  # [B, C, 1]
        return torch.addcmul(bias, x, scale)  # [B, C, T]: x * scale + bias in one kernel

    def _table(self, pending: tuple[Tensor, ...]) -> Tensor:
        """``[K, 2C]``: each bucket's scale, then its bias plus ``sum(pending) * scale`` (float32 sums, one
        rounding)."""
        scale, bias = self.scale_embed.weight.detach(), self.bias_embed.weight.detach()  # [K, C] each
        if pending:
            bias = (bias.float() + float_sum(pending)[None, :] * scale.float()).to(bias.dtype)  # [K, C]
        return torch.cat([scale, bias], dim=1)


class DepthwiseResidualUnit(nn.Module):
    """``x + conv2(snake2(conv1(snake1(x))))``: ``block.0`` Snake, ``block.1`` depthwise causal k7 dilation ``d``,
    ``block.2`` Snake, ``block.3`` full 1x1 conv.

    Where the Snakes run fused (CUDA, no autograd, not under ``torch.compile``) the unit is three kernels, written
    over ``x`` (the unit consumes its input): ``snake_cat`` (Snake 1 of ``x`` plus the biases pending on it, with the
    depthwise conv's state in front), ``depthwise_snake`` (the depthwise conv with Snake 2 applied to its output:
    PyTorch's generic depthwise kernel was about 16 ms of the 64 x 25-frame step on the H200) and one GEMM (the 1x1
    conv with the residual read in the GEMM's epilogue, as the Qwen3-TTS unit does: a ``baddbmm``, or in float32
    ``matmul_choice.residual_matmul_``'s choice of cuBLAS or the 3xTF32 kernel over ``[B T, C]`` rows). A
    channels-last residual stream (after the transposed conv as one GEMM) stays channels-last through all three. The
    1x1 conv's bias is left pending (``pending.run_chain``): the next unit's Snake adds it, or after the block's last
    unit the next block's ``ScaleBias`` table or the last layer."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.block = StreamSequential([
            Snake(channels),
            CausalConv(channels, channels, 7, dilation=dilation, groups=channels),
            Snake(channels),
            CausalConv(channels, channels, 1),
        ])
        self.matmul_choice = matmul_choice.MatmulChoice()  # the 1x1 conv's GEMM form (float32: 3xTF32 or cuBLAS)
        self.in_bias = BiasSum()  # the pending biases' sum, added by Snake 1's kernel

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext,
                pending: tuple[Tensor, ...] = ()) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """``pending``: biases still to add to ``x`` (only where ``folds_biases``; ``pending.run_chain``). Fused, the
        unit returns ``(x, lengths, (*pending, conv2's bias))``: ``x`` holds ``W2 @ h`` added to the stored stream."""
        act1, conv1, act2, conv2 = self.block
        if folds_biases(act1, x):
            h, _ = conv1(x, lengths, ctx, act=act1, in_bias=self.in_bias(pending),
                         then_act=act2)  # [B, C, T], Snake 2 applied, laid out as x
            # [B, C, T]: x + W2 @ h (the pending biases and b2 still to add)
            x = matmul_choice.residual_matmul_(x, conv2.conv.weight[:, :, 0], h, self.matmul_choice)
            return x, lengths, (*pending, conv2.conv.bias)
        if pending:
            raise ValueError("pending biases need the fused path (folds_biases)")
        h, _ = conv1(x, lengths, ctx, act=act1)  # [B, C, T]
        h, _ = conv2(h, lengths, ctx, act=act2)  # [B, C, T]
        return h.add_(x), lengths, ()


class DepthwiseDecoderBlock(nn.Module):
    """``block = [Snake(Cin), CausalTransConv(Cin -> Cout, 2s, s), DepthwiseResidualUnit d=1, d=3, d=9]``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.block = StreamSequential([
            Snake(in_channels),
            CausalTransConv(in_channels, out_channels, 2 * stride, stride),
            DepthwiseResidualUnit(out_channels, 1),
            DepthwiseResidualUnit(out_channels, 3),
            DepthwiseResidualUnit(out_channels, 9),
        ])

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """Returns ``(x, lengths, pending)``: where ``folds_biases``, the upsampling conv's and the units' 1x1 convs'
        biases are still pending on ``x`` (the next ``ScaleBias`` or the last layer adds them); else ``()``."""
        act, upsample, *units = self.block
        fold = folds_biases(act, x)
        x, lengths = upsample(x, lengths, ctx, act=act, bias_later=fold)  # [B, Cout, T * s]
        return run_chain(units, x, lengths, ctx, (upsample.conv.bias,) if fold else ())  # [B, Cout, T * s]
