"""A dense residual unit's second half in one kernel: ``x += W2 @ act2(conv1(a) + b1)``, in place.

A dense residual unit is ``x + conv2(act2(conv1(act1(x))))`` (``DenseResidualUnit``), with ``conv1`` a
dense causal k7 conv of dilation ``d`` and ``conv2`` a 1x1 conv whose bias stays pending (``pending.run_chain``).
The Snake kernel writes ``a = act1(x)`` (state columns in front, channels-last); then, unfused, ``conv1`` writes
``h = act2(conv1(a) + b1)`` ``[B, C, T]`` and a batched GEMM reads ``h`` and ``x`` and writes ``x + W2 @ h``: two
full passes over ``h`` that only carry it from one kernel to the next. At the decoder's last two levels (192 and 96
channels) a program of ``conv_gemm_tma.py``'s split tile holds every channel of its columns, so its epilogue can
finish the unit: ``h`` (rounded to ``x``'s dtype, as the unfused form stores it) times ``W2`` on the tensor cores,
plus the residual read from ``x``, one rounding, stored over ``x``. The main loop is ``conv_gemm_tma``'s (TMA
loads, the same bleed rules: rows past an input row and weight rows past a tap's channels only reach channels or
columns that are never stored; here ``h`` is also zeroed past ``C`` before it meets ``W2``).

Rules: ``x`` ``[B, C, T]`` in any strides, overwritten (each program reads and writes only its own columns of it,
and reads ``a``, never ``x``, in its main loop); one program covers all ``C`` channels (``BLOCK_CO + BLOCK_CO2 >=
C``, ``fits``); ``w2`` ``[C, C]`` ``(out, in)``. Float32 accumulation throughout. Registered as
``code2wav::unit_tail_tma`` (CUDA: the kernel; CPU and meta: ``reference``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .conv_gemm import check_shapes, kernel_weight, reference as conv_reference
from . import conv_gemm_tma
from .conv_gemm_tma import TmaTile, descriptors

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_math import sine_for, snake_apply, snake_scale_inv

CONFIGS = (
    TmaTile(128, 64, 128, 64, 8, 3),  # 192 channels
    TmaTile(64, 32, 128, 32, 4, 3),  # 96 channels
)
"""Candidates, each for the channel counts ``fits`` allows (the choice measures those against the unfused unit).
``TmaTile(64, 32, 256, 32, 8, 3)`` was measured too and lost to the second at every 96-channel shape (H200)."""


def fits(channels: int, config: TmaTile) -> bool:
    """Whether one program of ``config`` covers ``channels`` channels without a wholly idle part (pure)."""
    return config.block_co < channels <= config.block_co + config.block_co2


def reference(a: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor, beta: Tensor, log_params: bool,
              w2: Tensor, x: Tensor) -> Tensor:
    """``x + w2 @ act2(conv1(a) + b1)`` in ``x``'s dtype, ``h`` rounded to it first (a new tensor)."""
    h = conv_reference(a, weight, bias, dilation, alpha, beta, log_params)  # [B, C, T]
    return torch.baddbmm(x, w2.to(x.dtype).expand(x.shape[0], -1, -1), h)  # [B, C, T]


if triton is not None:
    @triton.jit
    def _act_part(acc, co, b_ptr, alpha_ptr, beta_ptr, c, LOG_PARAMS: tl.constexpr, SINE: tl.constexpr):
        """``act2(acc + b1)`` for channels ``co``, zero past ``c`` (the caller rounds it to the stream's dtype, as the
        unfused form stores ``h``)."""
        co_in = co < c
        h = acc + tl.load(b_ptr + co, mask=co_in, other=0.0).to(tl.float32)[None, :]
        scale, inv = snake_scale_inv(tl.load(alpha_ptr + co, mask=co_in, other=0.0).to(tl.float32),
                                     tl.load(beta_ptr + co, mask=co_in, other=0.0).to(tl.float32), LOG_PARAMS)
        h = snake_apply(h, scale[None, :], inv[None, :], SINE)
        return tl.where(co_in[None, :], h, 0.0)

    @triton.jit
    def _w2_tile(w2_ptr, ci, co, c):
        """``W2[co, ci]`` as a ``[len(ci), len(co)]`` tile (``h @ tile``), zero past ``c``."""
        return tl.load(w2_ptr + co[None, :] * c + ci[:, None], mask=(ci[:, None] < c) & (co[None, :] < c), other=0.0)

    @triton.jit
    def _residual_store(out, co, t, b, x_ptr, c, num_cols, stride_xb, stride_xc, stride_xt):
        at = x_ptr + b * stride_xb + co[None, :] * stride_xc + t[:, None] * stride_xt
        mask = (co[None, :] < c) & (t[:, None] < num_cols)
        out += tl.load(at, mask=mask, other=0.0).to(tl.float32)
        tl.store(at, out.to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _unit_tail_kernel(a_desc, w_desc, w2_desc, b_ptr, alpha_ptr, beta_ptr, p_ptr, x_ptr, c, num_cols,
                          rows_per_batch, ksize, dilation, stride_xb, stride_xc, stride_xt, LOG_PARAMS: tl.constexpr,
                          SINE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_CO2: tl.constexpr,
                          BLOCK_CI: tl.constexpr):
        tb = tl.program_id(0)
        b = tl.program_id(1)
        t0 = tb * BLOCK_T
        row0 = b * rows_per_batch + t0
        acc = tl.zeros([BLOCK_T, BLOCK_CO], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_T, BLOCK_CO2], dtype=tl.float32)
        num_ci_blocks = tl.cdiv(c, BLOCK_CI)
        for step in range(0, ksize * num_ci_blocks):  # conv1: (tap, input-channel block) pairs
            k = step // num_ci_blocks
            ci0 = (step % num_ci_blocks) * BLOCK_CI
            a = a_desc.load([row0 + k * dilation, ci0])  # [BLOCK_T, BLOCK_CI]
            acc = tl.dot(a, w_desc.load([k * c, ci0]).T, acc)  # [BLOCK_T, BLOCK_CO]
            acc2 = tl.dot(a, w2_desc.load([k * c + BLOCK_CO, ci0]).T, acc2)  # [BLOCK_T, BLOCK_CO2]
        co1 = tl.arange(0, BLOCK_CO)
        co2 = BLOCK_CO + tl.arange(0, BLOCK_CO2)
        h1 = _act_part(acc, co1, b_ptr, alpha_ptr, beta_ptr, c, LOG_PARAMS, SINE).to(x_ptr.dtype.element_ty)
        h2 = _act_part(acc2, co2, b_ptr, alpha_ptr, beta_ptr, c, LOG_PARAMS, SINE).to(x_ptr.dtype.element_ty)
        out1 = tl.dot(h1, _w2_tile(p_ptr, co1, co1, c))  # [BLOCK_T, BLOCK_CO]: conv2's first output channels
        out1 = tl.dot(h2, _w2_tile(p_ptr, co2, co1, c), out1)
        out2 = tl.dot(h1, _w2_tile(p_ptr, co1, co2, c))  # [BLOCK_T, BLOCK_CO2]
        out2 = tl.dot(h2, _w2_tile(p_ptr, co2, co2, c), out2)
        t = t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T] columns
        b64 = b.to(tl.int64)
        _residual_store(out1, co1, t, b64, x_ptr, c, num_cols, stride_xb, stride_xc, stride_xt)
        _residual_store(out2, co2, t, b64, x_ptr, c, num_cols, stride_xb, stride_xc, stride_xt)


def _launch(a: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor, beta: Tensor, log_params: bool,
            w2: Tensor, x: Tensor, config: TmaTile) -> None:
    batch, channels, num_cols = x.shape
    if not fits(channels, config):
        raise ValueError(f"unit_tail_tma: tile {tuple(config)} does not cover {channels} channels in one program")
    a_desc, w_desc, w2_desc, a, weight, rows_per_batch = descriptors(a, weight, config)
    grid = (triton.cdiv(num_cols, config.block_t), batch)
    _unit_tail_kernel[grid](a_desc, w_desc, w2_desc, bias, alpha, beta if log_params else alpha,
                            w2.to(x.dtype).contiguous(), x,
                            channels, num_cols, rows_per_batch, weight.shape[2], dilation, x.stride(0), x.stride(1),
                            x.stride(2), LOG_PARAMS=log_params, SINE=sine_for(x), BLOCK_T=config.block_t,
                            BLOCK_CO=config.block_co, BLOCK_CO2=config.block_co2, BLOCK_CI=config.block_ci,
                            num_warps=config.num_warps, num_stages=config.num_stages)


def _check(a: Tensor, weight: Tensor, bias: Tensor, dilation: int, w2: Tensor, x: Tensor) -> None:
    check_shapes(a, weight, bias, dilation)
    channels = x.shape[1]
    expected = (x.shape[0], channels, a.shape[2] - (weight.shape[2] - 1) * dilation)
    if weight.shape[:2] != (channels, channels) or w2.shape != (channels, channels) or tuple(x.shape) != expected:
        raise ValueError(f"unit_tail_tma needs a [B, C, P + T] input, [C, C, K] and [C, C] weights and a [B, C, T] "
                         f"residual, got {tuple(a.shape)}, {tuple(weight.shape)}, {tuple(w2.shape)}, "
                         f"{tuple(x.shape)}")
    if a.device.type != "meta" and a.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("unit_tail_tma: the input and the residual share memory (the kernel writes the residual while "
                         "other programs read the input)")


@torch.library.custom_op("code2wav::unit_tail_tma", mutates_args=("x",))
def unit_tail_tma(a: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor, beta: Tensor,
                  log_params: bool, w2: Tensor, x: Tensor, config: list[int]) -> None:
    """``x += w2 @ act2(conv1(a) + bias)`` in place: ``a`` ``[B, C, P + T]`` (channels-last read in place, else
    copied), ``weight`` ``[C, C, K]``, ``bias``/``alpha``/``beta`` ``[C]`` (``act2``), ``w2`` ``[C, C]``, ``x``
    ``[B, C, T]``, ``config`` the six fields of a ``TmaTile`` that ``fits`` ``C``."""
    _check(a, weight, bias, dilation, w2, x)
    if x.is_cuda and conv_gemm_tma.triton is not None:  # host TMA descriptors (conv_gemm_tma's import)
        _launch(a, weight, bias, dilation, alpha, beta, log_params, w2, x, TmaTile(*config))
    else:
        x.copy_(reference(a, weight, bias, dilation, alpha, beta, log_params, w2, x))


@register_flop_formula(torch.ops.code2wav.unit_tail_tma)
def _flops(a_shape, w_shape, *args, **kwargs) -> int:
    channels, _, ksize = w_shape
    num_cols = a_shape[0] * (a_shape[2] - (ksize - 1) * args[1])  # args[1]: the dilation
    return 2 * num_cols * channels * channels * (ksize + 1)  # conv1's taps and conv2


@unit_tail_tma.register_fake
def _(a: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor, beta: Tensor, log_params: bool,
      w2: Tensor, x: Tensor, config: list[int]) -> None:
    _check(a, weight, bias, dilation, w2, x)


def run_interpreted(a: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor, beta: Tensor,
                    log_params: bool, w2: Tensor, x: Tensor, config: TmaTile = TmaTile(16, 16, 16, 16, 1, 1)) -> None:
    """The Triton kernel on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton was
    imported), for the CPU tests."""
    _check(a, weight, bias, dilation, w2, x)
    _launch(a, kernel_weight(weight), bias, dilation, alpha, beta, log_params, w2, x, config)
