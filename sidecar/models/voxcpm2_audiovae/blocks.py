"""Building blocks of the VoxCPM2 AudioVAE decoder, written for exact streaming.

Every block's ``forward(x, lengths, ctx)`` takes ``x`` ``[B, C, T]`` and per-row valid lengths ``[B]`` (columns
past a row's length are right padding) and returns ``(y, lengths_out)``. Stateful blocks read their entry of
``ctx.state_in`` (the block's input tail from the previous call), run over ``[tail, x]`` without padding and
write the tail that ends at each row's last *valid* column to ``ctx.state_out``, so padding never reaches the
state. A zero state is the one-shot left zero padding. Weights are plain, already folded tensors (weight norm
is folded at load time); parameter names match the checkpoint's after folding (``model.0.weight``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels import depthwise  # (registers torch.ops.code2wav.depthwise_snake)
from ...kernels import matmul_choice
from ...kernels import snake_conv as _registers_snake_conv_out  # noqa: F401  (torch.ops.code2wav.snake_conv_out)
from ...kernels import state_cat  # (registers torch.ops.code2wav.state_cat)
from ...kernels import transposed
from ...kernels.derived import DerivedTensor, kernel_forms
from ...kernels.pending import BiasSum, float_sum, folds_biases, run_chain
from ...kernels.snake import cat_with_tail  # (registers torch.ops.code2wav.snake_cat*)


@dataclass
class StreamCtx:
    """State in and out of one batched call; keys are the stateful blocks' ``state_key``s."""

    state_in: dict[str, Tensor]
    state_out: dict[str, Tensor] = field(default_factory=dict)
    sr_bucket: Tensor | None = None  # [B] long, the sample-rate bucket of each row


def depthwise_taps(x: Tensor, weight: Tensor, bias: Tensor, dilation: int) -> Tensor:
    """A depthwise ``conv1d`` (``groups == C``, no padding) as ``k`` shifted multiply-adds: ``x`` ``[B, C, P + T]``,
    ``weight`` ``[C, 1, k]`` -> ``[B, C, T]``. Eager, it is ``2k`` kernels; under ``torch.compile`` Inductor fuses it
    with the Snake before it and the state ``cat`` into one kernel, where a depthwise ``conv1d`` stays an extern
    call to PyTorch's generic depthwise kernel (on the H200 over half of the compiled bf16 step at 64 rows x 25
    frames; docs/voxcpm2.md)."""
    kernel_size = weight.shape[2]
    num_out = x.shape[2] - (kernel_size - 1) * dilation
    taps = weight[:, 0, :, None]  # [C, k, 1]
    y = bias[:, None] + taps[:, 0] * x[:, :, :num_out]  # [B, C, T]
    for k in range(1, kernel_size):
        y = y + taps[:, k] * x[:, :, k * dilation:k * dilation + num_out]  # [B, C, T]
    return y


class StatefulBlock(nn.Module):
    """A block that carries ``state_shape()`` per row between calls; ``state_key`` is set by the model."""

    state_key: str = ""

    def state_shape(self) -> tuple[int, ...] | None:
        return None


class Snake(nn.Module):
    """``x + sin(alpha * x)**2 / (alpha + 1e-9)`` with ``alpha`` ``[1, C, 1]`` used as stored (no exp, no beta).

    ``fused`` (set by ``VoxCPM2AudioVAEDecoder.use_fused_kernels``): the conv after it applies it with the Triton
    kernel ``code2wav::snake_cat`` (``code2wav::snake_conv_out`` before the last, one-channel conv) on CUDA tensors,
    except while ``torch.compile`` traces."""

    fused = False

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def runs_fused(self, x: Tensor) -> bool:
        return self.fused and x.is_cuda and not torch.compiler.is_compiling()

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx) -> tuple[Tensor, Tensor]:
        # 5 kernels, one temporary: the divide and the residual add fused (addcdiv, written over the temporary), and
        # no per-call reciprocal of alpha (was 7 kernels)
        out = torch.mul(self.alpha, x).sin_().square_()  # [B, C, T]
        return torch.addcdiv(x, out, self.alpha + 1e-9, out=out), lengths  # x + sin^2(alpha x) / (alpha + 1e-9)


class CausalConv(StatefulBlock):
    """Stride-1 ``Conv1d`` padded ``(k-1)*d`` on the left only; that many input columns are its state."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_channels, in_channels // groups, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.in_channels = in_channels
        self.dilation = dilation
        self.groups = groups
        self.num_state_cols = (kernel_size - 1) * dilation
        # the last layer (one output channel): Snake and the conv in one kernel (``kernels/snake_conv.py``)
        self.one_output = out_channels == 1 and dilation == 1 and groups == 1 and kernel_size > 1
        # where its Snake does not run fused: the state join and tail as one op (``kernels/state_cat.py``) where the
        # family switched its kernels on (set by ``conv_choice.switch_kernels``)
        self.kernels_on = False

    def state_shape(self) -> tuple[int, ...] | None:
        return (self.in_channels, self.num_state_cols) if self.num_state_cols else None

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx, act: Snake | None = None,
                in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``act``: the Snake before this conv, applied here (fused with the state concatenation when it can).
        ``in_bias`` ``[C]``: biases still pending on ``x`` (``pending.run_chain``), only for the fused last layer."""
        fused = act is not None and act.runs_fused(x)
        if fused and self.one_output:
            alpha = act.alpha.view(-1)  # [C]
            y, tail = torch.ops.code2wav.snake_conv_out(x, ctx.state_in[self.state_key], alpha, alpha, lengths,
                                                        False, self.weight, self.bias, in_bias)  # [B, 1, T]
            ctx.state_out[self.state_key] = tail  # [B, C, P]
            return y, lengths
        if in_bias is not None:
            raise ValueError("in_bias needs the fused last layer (act.runs_fused(x), one output channel)")
        if fused:
            state = ctx.state_in[self.state_key] if self.num_state_cols else None
            alpha = act.alpha.view(-1)  # [C]
            x, tail = torch.ops.code2wav.snake_cat(x, state, alpha, alpha, lengths, False)  # [B, C, P + T]
            if self.num_state_cols:
                ctx.state_out[self.state_key] = tail  # [B, C, P]
        else:
            if act is not None:
                x, _ = act(x, lengths, ctx)  # [B, C, T]
            if self.num_state_cols:
                x, ctx.state_out[self.state_key] = state_cat.join(x, ctx.state_in[self.state_key], lengths,
                                                                  op=self.kernels_on)  # [B, C, P + T], [B, C, P]
        is_depthwise = self.groups > 1 and self.groups == self.in_channels == self.weight.shape[0]  # no multiplier
        if is_depthwise and torch.compiler.is_compiling():
            return depthwise_taps(x, self.weight, self.bias, self.dilation), lengths  # [B, C, T], fused by Inductor
        y = F.conv1d(x, self.weight, self.bias, dilation=self.dilation, groups=self.groups)  # [B, C_out, T]
        return y, lengths


class CausalTransConv(StatefulBlock):
    """``ConvTranspose1d`` kernel ``2s`` stride ``s`` keeping the first ``L*s`` of its ``(L+1)*s`` samples.

    Output frame ``t`` depends on input frames ``t`` and ``t-1``: the last input frame is the state. A chunk
    transpose-convolves ``x`` alone, adds the previous frame's share (``prev @ W[:, :, s:]``, no second bias) into
    its first ``s`` samples and drops its last ``s`` (the spec's "add" form: half the extra work of running on
    ``[prev, x]``, and with a zero state it is bit for bit the one-shot computation).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(in_channels, out_channels, 2 * stride))  # [Cin, Cout, 2s]
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.in_channels = in_channels
        self.stride = stride
        self.pairs = transposed.SnakeThenTransposedConv(stride)  # where the Snake runs fused

    def state_shape(self) -> tuple[int, ...] | None:
        return (self.in_channels, 1)

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx, act: Snake | None = None,
                bias_later: bool = False) -> tuple[Tensor, Tensor]:
        """``act``: the Snake before this conv, applied here. Where it runs fused, the Snake writes the frame pairs
        of ``[prev, act(x)]`` and the conv is one GEMM over them (``kernels/transposed.py``; the output is then
        channels-last), and ``bias_later`` leaves its bias out (the next kernel adds it)."""
        s = self.stride
        if act is not None and act.runs_fused(x):
            alpha = act.alpha.view(-1)  # [C]
            y, tail = self.pairs(x, ctx.state_in[self.state_key], alpha, alpha, lengths, False, self.weight,
                                 None if bias_later else self.bias)  # [B, Cout, L * s] channels-last
            ctx.state_out[self.state_key] = tail  # [B, Cin, 1]
            return y, lengths * s
        if bias_later:
            raise ValueError("bias_later needs the fused Snake (act.runs_fused(x))")
        num_in = x.shape[2]
        if act is not None:
            x, _ = act(x, lengths, ctx)  # [B, Cin, L]
        prev = ctx.state_in[self.state_key].to(x.dtype)  # [B, Cin, 1]
        _, ctx.state_out[self.state_key] = cat_with_tail(x, prev, lengths)  # [B, Cin, 1]: the last valid frame
        y = F.conv_transpose1d(x, self.weight, self.bias, stride=s)[:, :, :num_in * s]  # [B, Cout, L * s]
        carry = torch.einsum("bc,cok->bok", prev[:, :, 0], self.weight[:, :, s:])  # [B, Cout, s]
        head = y[:, :, :s] + carry  # [B, Cout, s]
        return torch.cat([head, y[:, :, s:]], dim=2), lengths * s  # [B, Cout, L * s]


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


class Sequence(nn.ModuleList):
    """Runs its blocks in order threading ``(x, lengths)``; children are named ``0``, ``1``, ... like upstream."""

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        for module in self:
            x, lengths = module(x, lengths, ctx)
        return x, lengths


class ResidualUnit(nn.Module):
    """``x + conv2(snake2(conv1(snake1(x))))``: ``block.0`` Snake, ``block.1`` depthwise causal k7 dilation ``d``,
    ``block.2`` Snake, ``block.3`` full 1x1 conv.

    Where the Snakes run fused (CUDA, no autograd, not under ``torch.compile``) the unit is three kernels, written
    over ``x`` (the unit consumes its input): ``snake_cat`` (Snake 1 of ``x`` plus the biases pending on it, with the
    depthwise conv's state in front), ``depthwise_snake`` (the depthwise conv with Snake 2 applied to its output:
    PyTorch's generic depthwise kernel was about 16 ms of the 64 x 25-frame step on the H200) and one GEMM (the 1x1
    conv with the residual read in the GEMM's epilogue, as the Qwen3-TTS unit does: a ``baddbmm``, or in float32
    ``matmul_choice.residual_matmul_``'s choice of cuBLAS or the 3xTF32 kernel over ``[B T, C]`` rows). The 1x1
    conv's bias is left pending (``pending.run_chain``): the next unit's Snake adds it, or after the block's last
    unit the next block's ``ScaleBias`` table or the last layer."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.block = Sequence([
            Snake(channels),
            CausalConv(channels, channels, 7, dilation=dilation, groups=channels),
            Snake(channels),
            CausalConv(channels, channels, 1),
        ])
        self.matmul_choice = matmul_choice.MatmulChoice()  # the 1x1 conv's GEMM form (float32: 3xTF32 or cuBLAS)
        self.in_bias = BiasSum()  # the pending biases' sum, added by Snake 1's kernel

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx,
                pending: tuple[Tensor, ...] = ()) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """``pending``: biases still to add to ``x`` (only where ``folds_biases``; ``pending.run_chain``). Fused, the
        unit returns ``(x, lengths, (*pending, conv2's bias))``: ``x`` holds ``W2 @ h`` added to the stored stream."""
        act1, conv1, act2, conv2 = self.block
        if folds_biases(act1, x):
            return self._fused(x, lengths, ctx, self.in_bias(pending)), lengths, (*pending, conv2.bias)
        if pending:
            raise ValueError("pending biases need the fused path (folds_biases)")
        h, _ = conv1(x, lengths, ctx, act=act1)  # [B, C, T]
        h, _ = conv2(h, lengths, ctx, act=act2)  # [B, C, T]
        return h.add_(x), lengths, ()

    def _fused(self, x: Tensor, lengths: Tensor, ctx: StreamCtx, in_bias: Tensor | None) -> Tensor:
        act1, conv1, act2, conv2 = self.block
        alpha1, alpha2 = act1.alpha.view(-1), act2.alpha.view(-1)  # [C], [C]
        # a channels-last residual stream (after the transposed conv as one GEMM) stays channels-last: the cat, the
        # depthwise conv's output (its taps then load whole vectors, kernels/depthwise.py) and the baddbmm's operand
        x_cat, tail = torch.ops.code2wav.snake_cat(x, ctx.state_in[conv1.state_key], alpha1, alpha1, lengths, False,
                                                   in_bias, depthwise.channels_last(x))  # [B, C, P + T] of x + in_bias
        ctx.state_out[conv1.state_key] = tail  # [B, C, P]
        h = torch.ops.code2wav.depthwise_snake(x_cat, conv1.weight, conv1.bias, conv1.dilation, alpha2, alpha2,
                                               False)  # [B, C, T], Snake 2 applied, laid out as x_cat
        # [B, C, T]: x + W2 @ h (the pending biases and b2 still to add)
        return matmul_choice.residual_matmul_(x, conv2.weight[:, :, 0], h, self.matmul_choice)


class DecoderBlock(nn.Module):
    """``block = [Snake(Cin), CausalTransConv(Cin -> Cout, s), ResidualUnit d=1, d=3, d=9]``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.block = Sequence([
            Snake(in_channels),
            CausalTransConv(in_channels, out_channels, stride),
            ResidualUnit(out_channels, 1),
            ResidualUnit(out_channels, 3),
            ResidualUnit(out_channels, 9),
        ])

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamCtx) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """Returns ``(x, lengths, pending)``: where ``folds_biases``, the upsampling conv's and the units' 1x1 convs'
        biases are still pending on ``x`` (the next ``ScaleBias`` or the last layer adds them); else ``()``."""
        act, upsample, *units = self.block
        fold = folds_biases(act, x)
        x, lengths = upsample(x, lengths, ctx, act=act, bias_later=fold)  # [B, Cout, T * s]
        return run_chain(units, x, lengths, ctx, (upsample.bias,) if fold else ())  # [B, Cout, T * s]
