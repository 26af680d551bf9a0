"""The channels-last implicit-GEMM conv of ``conv_gemm_cl.py`` with TMA loads and an output tile split in two.

What it computes is ``conv_gemm_cl.py``'s (``code2wav::conv_snake_cl``): for a channels-last ``x`` ``[B, C_in,
P + T]``, ``weight`` ``[C_out, C_in, K]`` (tap-major, ``kernel_weight``), ``bias`` and dilation ``d``, ``h[b, :, t]
= bias + sum_k weight[:, :, k] @ x[b, :, t + k d]``, then optionally Snake; float32 accumulation, one rounding to
``x``'s dtype, ``y`` written ``[B, C_out, T]`` contiguous.

Two differences, both for Hopper (sm_90):

- Every tile is loaded by the tensor memory accelerator (TMA) from a host-built descriptor: the input as rows
  ``[B L, C_in]`` (row ``b L' + t``, ``L'`` the batch stride in rows), the weight as rows ``[K C_out, C_in]``. A
  tap's input tile is rows ``t0 + k d`` onwards, so no address arithmetic or masks run in the loop, and the
  asynchronous copies leave the registers to the accumulator. Rows past an input row's end read the next row (or
  zeros past the tensor): they only reach output columns ``t >= T``, which are never stored (column ``t`` reads
  rows ``t + k d < L`` exactly when ``t < T``). Channels past ``C_in`` read zeros (the descriptors' bounds), and
  weight rows past a tap's ``C_out`` read the next tap's: they only reach output channels that are never stored.
- The output channels of a program are ``BLOCK_CO + BLOCK_CO2`` (two accumulators sharing each input tile; the
  second may be empty), so a layer of 96 or 192 channels is one tile wide without padding to 128 or 256: the
  dense decoder's last two levels (192 and 96 channels) spent a quarter of the channels-last kernel's MMAs on
  padding, and read each input tile twice for 192 channels.

The descriptors need 16-byte aligned rows: ``C_in`` a multiple of 8 (``ConvForms.offered`` offers the form only then,
on a GPU of compute capability 9 or later) and an input whose batch stride is a whole number of rows (``tma_ok``;
another input, such as a channels-first one, is copied to a contiguous channels-last one first). Registered as
``code2wav::conv_snake_tma`` (CUDA: the kernel; CPU and meta: ``conv_gemm.reference``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .conv_gemm import check_shapes, kernel_weight, register_conv_op
from .conv_gemm_cl import channels_last

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_math import sine_for, snake_apply, snake_scale_inv


class TmaTile(NamedTuple):
    """A tile shape and launch setting: output channels in two parts (``block_co2`` may be 0), columns, input
    channels per step, warps, pipeline stages."""

    block_co: int
    block_co2: int
    block_t: int
    block_ci: int
    num_warps: int
    num_stages: int


CONFIGS = (
    TmaTile(128, 0, 128, 64, 8, 4),
    TmaTile(128, 0, 256, 64, 8, 3),
    TmaTile(128, 64, 128, 64, 8, 3),  # 192 output channels in one tile
    TmaTile(64, 32, 128, 32, 4, 4),  # 96 output channels in one tile
)
"""Candidates (``ConvChoice`` measures them all per shape and keeps the fastest). On the H200 at 64 x 25 frames
(docs/design-notes.md) the second won at 768 and 384 channels, the last at 96; ``TmaTile(64, 32, 256, 32, 8, 4)``
was measured too and lost at every shape."""


def tma_ok(x: Tensor) -> bool:
    """Whether the descriptors can read the channels-last ``x`` ``[B, C_in, L]`` in place (16-byte aligned rows, a
    batch stride of whole rows; else the kernel reads a contiguous copy, which is, when ``C_in`` is a multiple of 8)."""
    return (x.stride(1) == 1 and x.data_ptr() % 16 == 0 and x.stride(2) % 8 == 0
            and (x.shape[0] == 1 or x.stride(0) % x.stride(2) == 0))


if triton is not None:
    @triton.jit
    def _store_part(acc, co, t, b, b_ptr, alpha_ptr, beta_ptr, y_ptr, c_out, num_cols_out, HAS_BIAS: tl.constexpr,
                    ACTIVATE: tl.constexpr, LOG_PARAMS: tl.constexpr, SINE: tl.constexpr):
        """Bias, Snake and the masked store of one accumulator ``[BLOCK_T, n]`` for channels ``co`` ``[n]``."""
        co_in = co < c_out
        if HAS_BIAS:
            acc += tl.load(b_ptr + co, mask=co_in, other=0.0).to(tl.float32)[None, :]
        if ACTIVATE:
            scale, inv = snake_scale_inv(tl.load(alpha_ptr + co, mask=co_in, other=0.0).to(tl.float32),
                                         tl.load(beta_ptr + co, mask=co_in, other=0.0).to(tl.float32), LOG_PARAMS)
            acc = snake_apply(acc, scale[None, :], inv[None, :], SINE)
        y_at = y_ptr + (b * c_out + co[None, :]) * num_cols_out + t[:, None]
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=co_in[None, :] & (t < num_cols_out)[:, None])

    @triton.jit
    def _conv_tma_kernel(x_desc, w_desc, w2_desc, b_ptr, alpha_ptr, beta_ptr, y_ptr, c_in, c_out, num_cols_out,
                         rows_per_batch, ksize, dilation, HAS_BIAS: tl.constexpr, ACTIVATE: tl.constexpr,
                         LOG_PARAMS: tl.constexpr, SINE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_CO: tl.constexpr, BLOCK_CO2: tl.constexpr, BLOCK_CI: tl.constexpr):
        ob = tl.program_id(0)  # output-channel blocks fastest: neighbouring programs share their input rows in L2
        tb = tl.program_id(1)
        b = tl.program_id(2)
        t0 = tb * BLOCK_T
        co0 = ob * (BLOCK_CO + BLOCK_CO2)
        row0 = b * rows_per_batch + t0
        acc = tl.zeros([BLOCK_T, BLOCK_CO], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_T, BLOCK_CO2 if BLOCK_CO2 > 0 else 16], dtype=tl.float32)
        num_ci_blocks = tl.cdiv(c_in, BLOCK_CI)
        for step in range(0, ksize * num_ci_blocks):  # (tap, input-channel block) pairs, one pipelined loop
            k = step // num_ci_blocks
            ci0 = (step % num_ci_blocks) * BLOCK_CI
            a = x_desc.load([row0 + k * dilation, ci0])  # [BLOCK_T, BLOCK_CI]
            w = w_desc.load([k * c_out + co0, ci0])  # [BLOCK_CO, BLOCK_CI]
            acc = tl.dot(a, w.T, acc)  # [BLOCK_T, BLOCK_CO]
            if BLOCK_CO2 > 0:
                w2 = w2_desc.load([k * c_out + co0 + BLOCK_CO, ci0])  # [BLOCK_CO2, BLOCK_CI]
                acc2 = tl.dot(a, w2.T, acc2)  # [BLOCK_T, BLOCK_CO2]
        t = t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T] output columns
        b64 = b.to(tl.int64)
        _store_part(acc, co0 + tl.arange(0, BLOCK_CO), t, b64, b_ptr, alpha_ptr, beta_ptr, y_ptr, c_out,
                    num_cols_out, HAS_BIAS, ACTIVATE, LOG_PARAMS, SINE)
        if BLOCK_CO2 > 0:
            _store_part(acc2, co0 + BLOCK_CO + tl.arange(0, BLOCK_CO2), t, b64, b_ptr, alpha_ptr, beta_ptr, y_ptr,
                        c_out, num_cols_out, HAS_BIAS, ACTIVATE, LOG_PARAMS, SINE)


def descriptors(x: Tensor, weight: Tensor, config: TmaTile) -> tuple:
    """``(x_desc, w_desc, w2_desc, x, weight, rows_per_batch)``: the TMA descriptors of the input rows and of the
    weight's two output-channel parts, over ``x`` and ``weight`` as read (a copy where the layout needed one)."""
    batch, c_in, num_in = x.shape
    c_out, _, ksize = weight.shape
    if c_in % 8:
        raise ValueError(f"conv_snake_tma: {c_in} input channels; the descriptors need a multiple of 8")
    if not channels_last(x) or not tma_ok(x):  # a fresh copy: a misaligned view may already count as contiguous
        x = x.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)  # [B, C_in, L], 16-byte rows
    if weight.stride(1) != 1 or weight.stride(0) != c_in or weight.stride(2) != c_out * c_in:
        weight = kernel_weight(weight)
    rows_per_batch = x.stride(0) // x.stride(2) if batch > 1 else num_in
    num_rows = (batch - 1) * rows_per_batch + num_in
    if num_rows >= 2**31:
        raise ValueError(f"conv_snake_tma: {num_rows} input rows are past TMA's 32-bit coordinates")
    x_desc = TensorDescriptor(x, [num_rows, c_in], [x.stride(2), 1], [config.block_t, config.block_ci])
    w_rows = weight.permute(2, 0, 1)  # [K, C_out, C_in] contiguous
    w_desc = TensorDescriptor(w_rows, [ksize * c_out, c_in], [c_in, 1], [config.block_co, config.block_ci])
    w2_desc = TensorDescriptor(w_rows, [ksize * c_out, c_in], [c_in, 1],
                               [config.block_co2 or config.block_co, config.block_ci])
    return x_desc, w_desc, w2_desc, x, weight, rows_per_batch


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
            beta: Tensor | None, log_params: bool, config: TmaTile) -> Tensor:
    batch, c_in, num_in = x.shape
    c_out, _, ksize = weight.shape
    num_cols_out = num_in - (ksize - 1) * dilation
    y = torch.empty((batch, c_out, num_cols_out), dtype=x.dtype, device=x.device)  # [B, C_out, T]
    if y.numel() == 0:
        return y
    x_desc, w_desc, w2_desc, x, weight, rows_per_batch = descriptors(x, weight, config)
    has_act = alpha is not None
    any_ptr = weight  # a valid pointer for the parameters a launch does not read
    grid = (triton.cdiv(c_out, config.block_co + config.block_co2), triton.cdiv(num_cols_out, config.block_t), batch)
    _conv_tma_kernel[grid](x_desc, w_desc, w2_desc, any_ptr if bias is None else bias, alpha if has_act else any_ptr,
                           beta if has_act and log_params else any_ptr, y, c_in, c_out, num_cols_out,
                           rows_per_batch, ksize, dilation, HAS_BIAS=bias is not None, ACTIVATE=has_act,
                           LOG_PARAMS=log_params, SINE=sine_for(x), BLOCK_T=config.block_t,
                           BLOCK_CO=config.block_co, BLOCK_CO2=config.block_co2, BLOCK_CI=config.block_ci,
                           num_warps=config.num_warps, num_stages=config.num_stages)
    return y


conv_snake_tma = register_conv_op("conv_snake_tma", _launch if triton is not None else None, TmaTile)
"""``code2wav::conv_snake_tma`` (``conv_gemm.register_conv_op``), as ``conv_snake_cl``; ``config`` a ``TmaTile``'s
fields."""


def run_interpreted(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
                    beta: Tensor | None, log_params: bool,
                    config: TmaTile = TmaTile(16, 16, 16, 16, 1, 1)) -> Tensor:
    """The Triton kernel on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton was
    imported), for the CPU tests (small tiles: many programs, partial tiles at every edge, both accumulators)."""
    check_shapes(x, weight, bias, dilation)
    return _launch(x, weight, bias, dilation, alpha, beta, log_params, config)
