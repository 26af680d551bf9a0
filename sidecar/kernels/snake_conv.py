"""The decoder's last layer, Snake then a causal conv to one output channel, as two small Triton kernels.

Both families end with ``Snake(C) -> CausalConv(C, 1, K)`` at the full audio rate (``T`` = every output sample).
Written as ``snake_cat`` and ``conv1d`` it writes the whole activated ``[B, C, P + T]`` input (the largest tensor
of the step) and reads it back in a cuDNN conv with one output channel (a GEMM whose tile is mostly padding).
Here the first kernel takes a block of columns of one row, applies Snake once per element (the state columns are
stored activated) and reduces over the channels into ``K`` float32 partial sums per column, one per tap (a
``[K, C] @ [C, columns]`` product per block of channels, ``tl.dot``; the per-tap reductions and read-modify-writes
of the sums it replaced took 1.29 ms at 64 x 25 frames in bf16 on the H200); the second adds each output sample's
``K`` shifted partial sums and the bias. One read of ``x``; ``K + 1`` float32 values per column written (not
``C``). (One kernel that recomputed Snake for each tap was sin-bound: 4.4 ms at batch 16 x 25 frames.)

What it computes, for ``x`` ``[B, C, T]``, ``state`` ``[B, C, P]`` with ``P = K - 1`` (dilation 1), the Snake
parameters of ``snake.py`` (``LOG_PARAMS`` as there), ``weight`` ``[1, C, K]``, ``bias`` ``[1]`` and optionally
``in_bias`` ``[C]`` (biases still pending on ``x``, ``pending.run_chain``: the activation is of ``x + in_bias``):

- ``cat = [state, snake(x)]`` rounded to ``x``'s dtype (as ``snake_cat`` stores it), never written;
- ``y = conv1d(cat, weight, bias)`` ``[B, 1, T]``, float32 accumulation, rounded once to ``x``'s dtype;
- ``tail[b] = cat[b, :, len_b : len_b + P]`` ``[B, C, P]``, the conv's next state (written by each row's first
  program).

Registered as ``code2wav::snake_conv_out`` (CUDA: the kernels; CPU and meta: ``snake_cat``'s torch expression and
``conv1d``), so CUDA graphs capture it and profiles name it; a family calls it where its ``Snake`` runs fused
(``use_fused_kernels``) and the conv has one output channel and dilation 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .snake import reference as snake_cat_reference

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_math import sine_for, snake_apply, snake_scale_inv

BLOCK_SAMPLES = 256
"""Output samples per program."""
BLOCK_CHANNELS = 32
"""Channels per inner step: a ``[BLOCK_CHANNELS, BLOCK_SAMPLES]`` float32 tile stays in registers (and the
reduction dimension of that step's ``tl.dot``, at least 16)."""


def reference(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
              weight: Tensor, bias: Tensor, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The torch expression (CPU and meta implementation, what the kernel is tested against): ``(y [B, 1, T],
    tail [B, C, P])``."""
    if in_bias is not None:
        x = x + in_bias[None, :, None]  # [B, C, T]
    cat, tail = snake_cat_reference(x, state, alpha, beta, lengths, log_params)  # [B, C, P + T], [B, C, P]
    return F.conv1d(cat, weight.to(x.dtype), bias.to(x.dtype)), tail  # [B, 1, T]


def check_shapes(x: Tensor, state: Tensor, weight: Tensor) -> None:
    """The shapes the kernel handles: one output channel, ``P = K - 1`` state columns (dilation 1)."""
    if weight.dim() != 3 or weight.shape[0] != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"snake_conv_out needs a [1, {x.shape[1]}, K] weight, got {tuple(weight.shape)}")
    if state.shape[:2] != x.shape[:2] or state.shape[2] != weight.shape[2] - 1:
        raise ValueError(f"snake_conv_out needs a [B, C, K - 1] state (dilation 1), got {tuple(state.shape)} for "
                         f"x {tuple(x.shape)} and kernel size {weight.shape[2]}")


if triton is not None:
    @triton.jit
    def _tap_sums_kernel(x_ptr, state_ptr, alpha_ptr, beta_ptr, lengths_ptr, w_ptr, sums_ptr, tail_ptr,
                         in_bias_ptr, num_channels, num_cols,
                         stride_xb, stride_xc, stride_xt, stride_sb, stride_sc, stride_st,
                         HAS_IN_BIAS: tl.constexpr, LOG_PARAMS: tl.constexpr, SINE: tl.constexpr,
                         IEEE: tl.constexpr, KSIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
        """``sums[b, k, u] = sum_c w[c, k] * cat[b, c, u]`` for a block of cat columns ``u`` (Snake once per element):
        per block of channels one ``[BLOCK_K, BLOCK_C] @ [BLOCK_C, BLOCK_T]`` product into a float32 accumulator,
        stored once; the row's first program also writes the tail."""
        ub = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        num_state_cols = KSIZE - 1
        total = num_cols + num_state_cols
        u = ub * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] columns of cat
        col = u - num_state_cols  # column of x; < 0: a state column
        from_x = (col >= 0) & (u < total)
        x_row = x_ptr + b * stride_xb
        s_row = state_ptr + b * stride_sb
        length = tl.load(lengths_ptr + b)
        i = tl.arange(0, BLOCK_P)
        tail_u = length + i  # [BLOCK_P] the next state: cat columns [len, len + P)
        tail_col = tail_u - num_state_cols
        kk = tl.arange(0, BLOCK_K)  # [BLOCK_K] taps (KSIZE of them, the rest padding for the dot's shape)
        acc = tl.zeros([BLOCK_K, BLOCK_T], dtype=tl.float32)
        for c0 in range(0, num_channels, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
            c_in = c < num_channels
            scale, inv = snake_scale_inv(tl.load(alpha_ptr + c, mask=c_in, other=0.0).to(tl.float32),
                                         tl.load(beta_ptr + c, mask=c_in, other=0.0).to(tl.float32), LOG_PARAMS)
            xv = tl.load(x_row + c[:, None] * stride_xc + col[None, :] * stride_xt,
                         mask=c_in[:, None] & from_x[None, :], other=0.0).to(tl.float32)
            if HAS_IN_BIAS:
                shift = tl.load(in_bias_ptr + c, mask=c_in, other=0.0).to(tl.float32)[:, None]  # [BLOCK_C, 1]
                xv = xv + shift
            v = snake_apply(xv, scale[:, None], inv[:, None], SINE)
            v = v.to(tail_ptr.dtype.element_ty)  # what snake_cat would have stored
            old = tl.load(s_row + c[:, None] * stride_sc + u[None, :] * stride_st,
                          mask=c_in[:, None] & (col < 0)[None, :], other=0.0)
            v = tl.where((col < 0)[None, :], old, v)  # [BLOCK_C, BLOCK_T] in x's dtype
            w = tl.load(w_ptr + c[None, :] * KSIZE + kk[:, None], mask=(kk < KSIZE)[:, None] & c_in[None, :],
                        other=0.0).to(v.dtype)  # [BLOCK_K, BLOCK_C]: w[c, k] transposed
            if IEEE:  # float32: FMAs, no TF32
                acc = tl.dot(w, v, acc, input_precision="ieee")  # [BLOCK_K, BLOCK_T]
            else:  # 16-bit inputs, exact products, float32 sums
                acc = tl.dot(w, v, acc)  # [BLOCK_K, BLOCK_T]
            if ub == 0:
                keep = c_in[:, None] & (i < num_state_cols)[None, :]
                tail_x = tl.load(x_row + c[:, None] * stride_xc + tail_col[None, :] * stride_xt,
                                 mask=keep & (tail_col >= 0)[None, :], other=0.0).to(tl.float32)
                if HAS_IN_BIAS:
                    tail_x = tail_x + shift
                tail_v = snake_apply(tail_x, scale[:, None], inv[:, None], SINE)
                tail_old = tl.load(s_row + c[:, None] * stride_sc + tail_u[None, :] * stride_st,
                                   mask=keep & (tail_col < 0)[None, :], other=0.0).to(tl.float32)
                tail_v = tl.where((tail_col < 0)[None, :], tail_old, tail_v)
                tl.store(tail_ptr + (b * num_channels + c[:, None]) * num_state_cols + i[None, :],
                         tail_v.to(tail_ptr.dtype.element_ty), mask=keep)
        tl.store(sums_ptr + (b * KSIZE + kk[:, None]) * total + u[None, :], acc,
                 mask=(kk < KSIZE)[:, None] & (u < total)[None, :])

    @triton.jit
    def _shifted_sum_kernel(sums_ptr, bias_ptr, y_ptr, num_cols, KSIZE: tl.constexpr, BLOCK_T: tl.constexpr):
        """``y[b, t] = bias + sum_k sums[b, k, t + k]``, rounded once to ``y``'s dtype."""
        tb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        total = num_cols + KSIZE - 1
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = t < num_cols
        acc = tl.zeros([BLOCK_T], dtype=tl.float32) + tl.load(bias_ptr).to(tl.float32)
        for k in tl.static_range(KSIZE):
            acc += tl.load(sums_ptr + (b * KSIZE + k) * total + t + k, mask=inside, other=0.0)
        tl.store(y_ptr + b * num_cols + t, acc.to(y_ptr.dtype.element_ty), mask=inside)


def _launch(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
            weight: Tensor, bias: Tensor, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    batch, channels, num_cols = x.shape
    ksize = weight.shape[2]
    y = torch.empty((batch, 1, num_cols), dtype=x.dtype, device=x.device)  # [B, 1, T]
    tail = torch.empty((batch, channels, ksize - 1), dtype=x.dtype, device=x.device)  # [B, C, P]
    if batch == 0 or num_cols == 0:
        return y, tail.copy_(state)  # no new columns: the state carries over
    weight = weight.contiguous()  # [1, C, K]: channel c, tap k at c * K + k
    total = num_cols + ksize - 1
    sums = torch.empty((batch, ksize, total), dtype=torch.float32, device=x.device)  # [B, K, P + T]
    _tap_sums_kernel[(triton.cdiv(total, BLOCK_SAMPLES), batch)](
        x, state, alpha, beta if log_params else alpha, lengths, weight, sums, tail,
        alpha if in_bias is None else in_bias, channels, num_cols,
        x.stride(0), x.stride(1), x.stride(2), state.stride(0), state.stride(1), state.stride(2),
        HAS_IN_BIAS=in_bias is not None, LOG_PARAMS=log_params, SINE=sine_for(x), IEEE=x.dtype == torch.float32,
        KSIZE=ksize, BLOCK_K=max(16, triton.next_power_of_2(ksize)), BLOCK_C=BLOCK_CHANNELS, BLOCK_T=BLOCK_SAMPLES,
        BLOCK_P=triton.next_power_of_2(max(ksize - 1, 1)), num_warps=4)
    _shifted_sum_kernel[(triton.cdiv(num_cols, BLOCK_SAMPLES), batch)](sums, bias, y, num_cols, KSIZE=ksize,
                                                                       BLOCK_T=BLOCK_SAMPLES, num_warps=4)
    return y, tail


@torch.library.custom_op("code2wav::snake_conv_out", mutates_args=())
def snake_conv_out(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
                   weight: Tensor, bias: Tensor, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(y [B, 1, T], tail [B, C, K - 1])``, see the module docstring. ``x`` ``[B, C, T]`` (any strides), ``state``
    ``[B, C, K - 1]``, ``alpha``/``beta`` ``[C]``, ``lengths`` ``[B]`` int64, ``weight`` ``[1, C, K]``, ``bias``
    ``[1]``, ``in_bias`` ``[C]`` or None."""
    check_shapes(x, state, weight)
    if x.is_cuda and triton is not None:
        return _launch(x, state.to(x.dtype), alpha, beta, lengths, log_params, weight, bias, in_bias)
    y, tail = reference(x, state, alpha, beta, lengths, log_params, weight, bias, in_bias)
    return y.contiguous(), tail.contiguous()


@snake_conv_out.register_fake
def _(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
      weight: Tensor, bias: Tensor, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    y = x.new_empty((x.shape[0], 1, x.shape[2]))  # [B, 1, T]
    return y, x.new_empty((x.shape[0], x.shape[1], weight.shape[2] - 1))  # [B, C, P]


@register_flop_formula(torch.ops.code2wav.snake_conv_out)
def _flops(x_shape, *args, out_shape=None, **kwargs) -> int:
    """Multiply-adds of the conv to one channel, as ``FlopCounterMode`` counts a conv."""
    batch, channels, num_cols = x_shape
    ksize = out_shape[1][2] + 1  # the tail is K - 1 columns
    return 2 * batch * num_cols * channels * ksize


def run_interpreted(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
                    weight: Tensor, bias: Tensor, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The Triton kernel on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton was
    imported): the CPU tests' check of its indexing."""
    check_shapes(x, state, weight)
    return _launch(x, state, alpha, beta, lengths, log_params, weight, bias, in_bias)
