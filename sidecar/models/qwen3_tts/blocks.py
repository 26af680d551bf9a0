"""Convolutional blocks of the Qwen3-TTS 12 Hz decoder, composed of the streaming kit's causal convs
(``models/streaming``).

Each block's ``forward(x, lengths, ctx)`` takes ``x`` ``[B, C, T]`` and the per-row valid lengths ``[B]`` and
returns ``(y, lengths_out)`` (the residual units and decoder blocks also thread pending biases,
``pending.run_chain``). Parameter names match the checkpoint (``.conv``, ``alpha``, ``beta``, ``dwconv``, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels import matmul_choice
from ...kernels.derived import kernel_forms
from ...kernels.pending import BiasSum, folds_biases, run_chain
from ..streaming import CausalConv, CausalTransConv, StreamActivation, StreamContext, StreamSequential, activated_join


class SnakeBeta(StreamActivation):
    """``x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2`` per channel; stateless; ``alpha`` and ``beta`` stored
    as logs (the Snake kernels' ``log_params``).

    ``fused`` (set by ``Qwen3TTSDecoder.use_fused_kernels``): the conv next to it applies it with the Triton kernels
    (``code2wav::snake_cat``, ``::snake_pairs``, ``::snake_conv_out``, the GEMM epilogues) on CUDA tensors, except
    while ``torch.compile`` traces (Inductor fuses the torch expression below with its neighbours itself)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def kernel_params(self) -> tuple[Tensor, Tensor, bool]:
        return self.alpha, self.beta, True

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext) -> tuple[Tensor, Tensor]:
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

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext) -> tuple[Tensor, Tensor]:
        h, _ = self.dwconv(x, lengths, ctx)  # [B, C, T]
        h = self.norm(h.transpose(1, 2))  # [B, T, C]
        h = self.pwconv2(F.gelu(self.pwconv1(h))) * self.gamma  # [B, T, C]
        return x + h.transpose(1, 2), lengths  # [B, C, T]


class DenseResidualUnit(nn.Module):
    """``x + conv2(act2(conv1(act1(x))))`` with ``conv1`` a dense causal k7 conv of dilation ``d`` and ``conv2`` k1.

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
    faster). In the fused form conv1's choice gets the rest of the unit too (``then_residual``): on a Hopper GPU at 96
    and 192 channels one kernel (``kernels/unit_tma.py``) can then run conv1, act2, conv2 and the residual add
    without writing ``h``, where it measured faster than conv1's best form followed by the GEMM."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)
        self.matmul_choice = matmul_choice.MatmulChoice()  # conv2's GEMM form in place (float32: 3xTF32 or cuBLAS)
        self.in_bias = BiasSum()  # the pending biases' sum, added by act1's kernel

    def _finish(self, x: Tensor, h: Tensor) -> Tensor:
        """``x += W2 @ h`` in place: the unit after its conv1 where that conv's form stops at ``h``."""
        return matmul_choice.residual_matmul_(x, self.conv2.conv.weight[:, :, 0], h, self.matmul_choice)

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext,
                pending: tuple[Tensor, ...] = ()) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """``pending``: biases that belong to ``x`` but are not in it (only where ``folds_biases``;
        ``pending.run_chain``). Returns ``(x, lengths, pending)``."""
        conv = self.conv2.conv
        # in place: x (the previous layer's output, used by nobody after this unit) becomes the output, so the
        # step's largest activations are not allocated twice (graph pool memory). Dynamo refuses a strided out=
        # (Inductor plans the memory itself), and autograd any out=: there the same sum runs out of place.
        in_place = kernel_forms()
        if folds_biases(self.act1, x):  # implies in_place: act2(conv1(act1(x + pending))), conv2's bias pending
            w2 = conv.weight[:, :, 0]  # [C, C]
            x, _ = self.conv1(x, lengths, ctx, act=self.act1, in_bias=self.in_bias(pending), then_act=self.act2,
                              then_residual=(w2, x, self._finish))  # [B, C, T], x updated in place
            return x, lengths, (*pending, conv.bias)
        if pending:  # its skip path would need them too: only the fused form carries them on
            raise ValueError("pending biases need the fused form (folds_biases, autograd off)")
        h, _ = self.conv1(x, lengths, ctx, act=self.act1)  # [B, C, T]
        h = activated_join(self.act2, h, lengths, ctx, self.conv2.state_key, 0)  # [B, C, T] (k1: no state)
        if not in_place:
            weight = conv.weight[:, :, 0].expand(h.shape[0], -1, -1)  # [B, C, C] (stride 0 over the batch)
            return torch.baddbmm(x + conv.bias[None, :, None], weight, h), lengths, ()  # [B, C, T]
        x.add_(conv.bias[None, :, None])  # [B, C, T]
        return matmul_choice.residual_matmul_(x, conv.weight[:, :, 0], h, self.matmul_choice), lengths, ()


class DenseDecoderBlock(nn.Module):
    """``block = [SnakeBeta, CausalTransConv(2r, r), DenseResidualUnit d=1, d=3, d=9]``."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        self.block = StreamSequential([
            SnakeBeta(in_dim),
            CausalTransConv(in_dim, out_dim, 2 * rate, rate),
            DenseResidualUnit(out_dim, 1),
            DenseResidualUnit(out_dim, 3),
            DenseResidualUnit(out_dim, 9),
        ])
        self.in_bias = BiasSum()  # the previous block's pending biases' sum, added by the Snake before upsampling

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext,
                pending: tuple[Tensor, ...] = ()) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """``pending``: biases still to add to ``x`` (only where ``folds_biases``; ``pending.run_chain``). Returns
        ``(x, lengths, pending)``: the upsampling conv's bias and the units' 1x1 biases stay pending."""
        act, upsample, *units = self.block
        fold = folds_biases(act, x)
        x, lengths = upsample(x, lengths, ctx, act=act, in_bias=self.in_bias(pending),
                              bias_later=fold)  # [B, C_out, T * r]
        return run_chain(units, x, lengths, ctx, (upsample.conv.bias,) if fold else ())  # [B, C_out, T * r]
