"""A dense stride-1 conv (any dilation) as an implicit GEMM over a channels-last input, for Hopper's tensor cores.

What it computes is ``conv_gemm.py``'s (``code2wav::conv_snake``): for ``x`` ``[B, C_in, P + T]``, ``weight``
``[C_out, C_in, K]``, ``bias`` and dilation ``d``, ``h[b, :, t] = bias + sum_k weight[:, :, k] @ x[b, :, t + k d]``,
then optionally Snake (``y = h + inv * sin(h * scale)^2``); float32 accumulation, one rounding to ``x``'s dtype.

The difference is the layout it reads. ``conv_gemm.py`` tiles the output as ``[channels, columns]`` and reads each
tap's input tile ``[C_in block, columns]`` at a column shift of ``k * d`` elements: an address of unknown alignment,
so the compiler cannot issue 16-byte asynchronous copies, the loads are synchronous and the tile loop does not
pipeline (its sm_90 PTX has ``wgmma`` but no ``cp.async``: ``tests/test_kernels_compile.py`` checks both here).
Here ``x`` is channels-last (each column's ``C_in`` channels contiguous, as the Snake kernels write a conv's input
for free) and the output tile is ``[columns, C_out block]``: a tap's input tile ``[columns, C_in block]`` is a block
of whole rows shifted by ``k * d`` rows, each row 16-byte aligned when ``C_in`` is a multiple of 8, so every load is
a pipelined ``cp.async`` feeding ``wgmma`` (an implicit GEMM: no im2col copy, the state columns read where the Snake
kernel wrote them in front of the chunk). ``M`` = columns, ``N`` = output channels, ``K`` = taps x input channels.
Bias and Snake run in the epilogue; the output is written ``[B, C_out, T]`` contiguous (as ``conv_gemm``'s; the
channels-last cuDNN and im2col forms return channels-last). Offsets within one row of the batch are 32-bit: a row's
input must hold fewer than 2**31 elements (``_launch`` says so otherwise; the form then fails and is left out).

``CONFIGS`` are the tile shapes ``ConvChoice`` measures (``conv_choice.py``); ``EVEN_CI`` drops the channel mask
where the block divides ``C_in``. Float32 is not offered (IEEE float32 on tensor cores is the 3xTF32 work of
``matmul.py``). Registered as ``code2wav::conv_snake_cl`` (CUDA: the kernel; CPU and meta: ``conv_gemm.reference``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .conv_gemm import ConvGemmTile, check_shapes, kernel_weight, register_conv_op

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_math import sine_for, snake_apply, snake_scale_inv


CONFIGS = (  # ConvGemmTile fields: output channels, columns per tile, input channels per step, warps, stages
    ConvGemmTile(128, 128, 64, 8, 3),
    ConvGemmTile(64, 128, 64, 4, 4),
    ConvGemmTile(128, 64, 64, 4, 4),
    ConvGemmTile(256, 128, 64, 8, 3),
    ConvGemmTile(128, 256, 64, 8, 3),
    ConvGemmTile(128, 128, 32, 4, 4),
)
"""Candidates (wgmma wants 64-row multiples and 4 or 8 warps); the choice keeps the fastest per shape."""


def channels_last(x: Tensor) -> bool:
    """Whether ``x`` ``[B, C, L]`` has each column's channels contiguous (what the kernel reads)."""
    return x.stride(1) == 1 or x.shape[1] == 1


if triton is not None:
    @triton.jit
    def _conv_cl_kernel(x_ptr, w_ptr, b_ptr, alpha_ptr, beta_ptr, y_ptr, c_in, c_out, num_cols_in, num_cols_out,
                        stride_xb, stride_xt, stride_wo, stride_wk, ksize, dilation,
                        HAS_BIAS: tl.constexpr, ACTIVATE: tl.constexpr, LOG_PARAMS: tl.constexpr,
                        SINE: tl.constexpr, EVEN_CI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr,
                        BLOCK_CI: tl.constexpr):
        ob = tl.program_id(0)  # output-channel blocks fastest: neighbouring programs share their input rows in L2
        tb = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] output columns
        co = ob * BLOCK_CO + tl.arange(0, BLOCK_CO)  # [BLOCK_CO]
        co_in = co < c_out
        x_row = x_ptr + b * stride_xb
        acc = tl.zeros([BLOCK_T, BLOCK_CO], dtype=tl.float32)
        num_ci_blocks = tl.cdiv(c_in, BLOCK_CI)
        for step in range(0, ksize * num_ci_blocks):  # (tap, input-channel block) pairs, one pipelined loop
            k = step // num_ci_blocks
            ci = (step % num_ci_blocks) * BLOCK_CI + tl.arange(0, BLOCK_CI)  # [BLOCK_CI]
            rows = t + k * dilation  # [BLOCK_T] input columns of this tap
            row_in = rows < num_cols_in
            if EVEN_CI:
                a = tl.load(x_row + rows[:, None] * stride_xt + ci[None, :], mask=row_in[:, None],
                            other=0.0)  # [BLOCK_T, BLOCK_CI]
                w = tl.load(w_ptr + k * stride_wk + co[None, :] * stride_wo + ci[:, None], mask=co_in[None, :],
                            other=0.0)  # [BLOCK_CI, BLOCK_CO]
            else:
                ci_in = ci < c_in
                a = tl.load(x_row + rows[:, None] * stride_xt + ci[None, :],
                            mask=row_in[:, None] & ci_in[None, :], other=0.0)  # [BLOCK_T, BLOCK_CI]
                w = tl.load(w_ptr + k * stride_wk + co[None, :] * stride_wo + ci[:, None],
                            mask=ci_in[:, None] & co_in[None, :], other=0.0)  # [BLOCK_CI, BLOCK_CO]
            acc = tl.dot(a, w, acc)  # [BLOCK_T, BLOCK_CO]
        if HAS_BIAS:
            acc += tl.load(b_ptr + co, mask=co_in, other=0.0).to(tl.float32)[None, :]
        if ACTIVATE:
            scale, inv = snake_scale_inv(tl.load(alpha_ptr + co, mask=co_in, other=0.0).to(tl.float32),
                                         tl.load(beta_ptr + co, mask=co_in, other=0.0).to(tl.float32), LOG_PARAMS)
            acc = snake_apply(acc, scale[None, :], inv[None, :], SINE)
        y_at = y_ptr + (b * c_out + co[None, :]) * num_cols_out + t[:, None]
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=co_in[None, :] & (t < num_cols_out)[:, None])


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
            beta: Tensor | None, log_params: bool, config: ConvGemmTile) -> Tensor:
    batch, c_in, num_in = x.shape
    c_out, _, ksize = weight.shape
    num_cols_out = num_in - (ksize - 1) * dilation
    y = torch.empty((batch, c_out, num_cols_out), dtype=x.dtype, device=x.device)  # [B, C_out, T]
    if y.numel() == 0:
        return y
    if num_in * c_in >= 2**31:
        raise ValueError(f"conv_snake_cl: a row of {num_in} x {c_in} elements is past the kernel's 32-bit offsets")
    if not channels_last(x):
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # [B, C_in, L], channels contiguous
    if weight.stride(1) != 1:
        weight = kernel_weight(weight)
    has_act = alpha is not None
    any_ptr = weight  # a valid pointer for the parameters a launch does not read
    grid = (triton.cdiv(c_out, config.block_co), triton.cdiv(num_cols_out, config.block_t), batch)
    _conv_cl_kernel[grid](x, weight, any_ptr if bias is None else bias, alpha if has_act else any_ptr,
                          beta if has_act and log_params else any_ptr, y, c_in, c_out, num_in, num_cols_out,
                          x.stride(0), x.stride(2), weight.stride(0), weight.stride(2), ksize, dilation,
                          HAS_BIAS=bias is not None, ACTIVATE=has_act, LOG_PARAMS=log_params, SINE=sine_for(x),
                          EVEN_CI=c_in % config.block_ci == 0, BLOCK_T=config.block_t, BLOCK_CO=config.block_co,
                          BLOCK_CI=config.block_ci, num_warps=config.num_warps, num_stages=config.num_stages)
    return y


conv_snake_cl = register_conv_op("conv_snake_cl", _launch if triton is not None else None, ConvGemmTile)
"""``code2wav::conv_snake_cl`` (``conv_gemm.register_conv_op``): ``x`` channels-last is read in place, another layout
is copied first; ``weight`` in ``kernel_weight``'s layout, else made; ``config`` a ``ConvGemmTile``'s fields."""


def run_interpreted(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
                    beta: Tensor | None, log_params: bool,
                    config: ConvGemmTile = ConvGemmTile(16, 16, 16, 1, 1)) -> Tensor:
    """The Triton kernel on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton was
    imported), for the CPU tests (small tiles: many programs, partial tiles at every edge)."""
    check_shapes(x, weight, bias, dilation)
    return _launch(x, weight, bias, dilation, alpha, beta, log_params, config)
