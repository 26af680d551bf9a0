"""A dense stride-1 conv (any dilation) as one implicit-GEMM Triton kernel, optionally with Snake in its epilogue.

What it computes, for ``x`` ``[B, C_in, P + T]`` (the stateful conv's input, state columns in front), ``weight``
``[C_out, C_in, K]``, ``bias`` ``[C_out]`` or None and dilation ``d`` with ``P = (K - 1) * d``:

- ``h[b, :, t] = bias + sum_k weight[:, :, k] @ x[b, :, t + k * d]`` ``[B, C_out, T]`` (``F.conv1d``);
- with Snake parameters, ``y = h + inv * sin(h * scale)^2`` per output channel (``snake.py``'s two forms), else
  ``y = h``; float32 accumulation, one rounding to ``x``'s dtype.

Each program owns a ``[BLOCK_CO, BLOCK_T]`` output tile of one row and walks the ``K * ceil(C_in / BLOCK_CI)``
(tap, input-channel block) pairs: a weight tile ``[BLOCK_CO, BLOCK_CI]`` times an input tile
``[BLOCK_CI, BLOCK_T]`` read straight from ``x`` at the tap's shift (no im2col copy), on tensor cores
(``tl.dot``). Why: cuDNN runs these convs (bf16, the residual units' ``k7`` convs) through NHWC kernels with a
layout conversion of the input, the weight and the output around each call (about 2.6 ms of a 15 ms batch-16
step on the H200) at a small fraction of the tensor cores' rate, and PyTorch adds the bias in another pass; here
the input is read in place, and the Snake after the conv (in a residual unit its only reader) comes in the
epilogue. Measured (H200, bf16; docs/design-notes.md, "Biases into the next kernel"): as tuned so far it is 1.5-2.4x slower than
cuDNN at batch 16 and 64 on the residual units' convs, and faster only at batch 1 for some shapes (5 of the 14
dense convs of a step) and for the small ``pre_conv``, so ``ConvChoice`` (``conv_choice.py``), which keeps it only
where it measured fastest, picks it there; better tiles (TMA loads, Hopper-sized tiles) are the open work.

Float32 inputs would multiply in IEEE float32 (``input_precision="ieee"``: no TF32, as the server's float32
promises); that is slow, so ``ConvChoice`` offers this kernel for bf16/fp16 only. ``ConvGemmTile`` is a tile
shape; ``CONFIGS`` the candidates a choice measures.

Registered as ``code2wav::conv_snake`` (CUDA: the kernel; CPU and meta: ``F.conv1d`` and Snake's torch expression).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .snake_math import activate

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_math import sine_for, snake_apply, snake_scale_inv


class ConvGemmTile(NamedTuple):
    """A tile shape and launch setting of the kernel."""

    block_co: int
    block_t: int
    block_ci: int
    num_warps: int
    num_stages: int


CONFIGS = (
    ConvGemmTile(128, 128, 64, 8, 3),
    ConvGemmTile(64, 128, 64, 4, 3),
    ConvGemmTile(128, 64, 64, 4, 3),
    ConvGemmTile(64, 256, 32, 8, 3),
)
"""Candidates: output channels x columns per tile, input channels per step, warps, pipeline stages."""


def reference(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
              beta: Tensor | None, log_params: bool) -> Tensor:
    """The torch expression in ``x``'s dtype (CPU and meta implementation; what the kernel is tested against)."""
    h = F.conv1d(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), dilation=dilation)  # [B, Co, T]
    return h if alpha is None else activate(h, alpha, beta, log_params)  # [B, C_out, T]


def check_shapes(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int) -> None:
    """A dense conv (no groups) over an input at least one receptive field long."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"conv_snake needs x [B, C_in, L] and weight [C_out, C_in, K], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"conv_snake needs a [C_out] bias, got {tuple(bias.shape)}")
    if dilation < 1 or x.shape[2] < (weight.shape[2] - 1) * dilation:
        raise ValueError(f"conv_snake: dilation {dilation} and kernel size {weight.shape[2]} need at least "
                         f"{(weight.shape[2] - 1) * dilation} input columns, got {x.shape[2]}")


if triton is not None:
    @triton.jit
    def _conv_kernel(x_ptr, w_ptr, b_ptr, alpha_ptr, beta_ptr, y_ptr, c_in, c_out, num_cols_out,
                     stride_xb, stride_xc, stride_xt, stride_wo, stride_wi, stride_wk, ksize, dilation,
                     HAS_BIAS: tl.constexpr, ACTIVATE: tl.constexpr,
                     LOG_PARAMS: tl.constexpr, SINE: tl.constexpr, IEEE: tl.constexpr, BLOCK_CO: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_CI: tl.constexpr):
        tb = tl.program_id(0)
        ob = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        co = ob * BLOCK_CO + tl.arange(0, BLOCK_CO)  # [BLOCK_CO]
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] output columns
        co_in = co < c_out
        t_in = t < num_cols_out
        x_row = x_ptr + b * stride_xb
        acc = tl.zeros([BLOCK_CO, BLOCK_T], dtype=tl.float32)
        num_ci_blocks = tl.cdiv(c_in, BLOCK_CI)
        for step in range(0, ksize * num_ci_blocks):  # (tap, input-channel block) pairs, one pipelined loop
            k = step // num_ci_blocks
            ci = (step % num_ci_blocks) * BLOCK_CI + tl.arange(0, BLOCK_CI)  # [BLOCK_CI]
            ci_in = ci < c_in
            w = tl.load(w_ptr + co[:, None] * stride_wo + ci[None, :] * stride_wi + k * stride_wk,
                        mask=co_in[:, None] & ci_in[None, :], other=0.0)  # [BLOCK_CO, BLOCK_CI]
            xt = tl.load(x_row + ci[:, None] * stride_xc + (t[None, :] + k * dilation) * stride_xt,
                         mask=ci_in[:, None] & t_in[None, :], other=0.0)  # [BLOCK_CI, BLOCK_T]
            if IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + co, mask=co_in, other=0.0).to(tl.float32)[:, None]
        if ACTIVATE:
            scale, inv = snake_scale_inv(tl.load(alpha_ptr + co, mask=co_in, other=0.0).to(tl.float32),
                                         tl.load(beta_ptr + co, mask=co_in, other=0.0).to(tl.float32), LOG_PARAMS)
            acc = snake_apply(acc, scale[:, None], inv[:, None], SINE)
        y_at = y_ptr + (b * c_out + co[:, None]) * num_cols_out + t[None, :]
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=co_in[:, None] & t_in[None, :])


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
            beta: Tensor | None, log_params: bool, config: ConvGemmTile) -> Tensor:
    batch, c_in, num_in = x.shape
    c_out, _, ksize = weight.shape
    num_cols_out = num_in - (ksize - 1) * dilation
    y = torch.empty((batch, c_out, num_cols_out), dtype=x.dtype, device=x.device)  # [B, C_out, T]
    if y.numel() == 0:
        return y
    has_act = alpha is not None
    any_ptr = weight  # a valid pointer for the parameters a launch does not read
    grid = (triton.cdiv(num_cols_out, config.block_t), triton.cdiv(c_out, config.block_co), batch)
    _conv_kernel[grid](x, weight, any_ptr if bias is None else bias, alpha if has_act else any_ptr,
                       beta if has_act and log_params else any_ptr, y, c_in, c_out, num_cols_out,
                       x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1), weight.stride(2),
                       ksize, dilation, HAS_BIAS=bias is not None, ACTIVATE=has_act,
                       LOG_PARAMS=log_params, SINE=sine_for(x), IEEE=x.dtype == torch.float32,
                       BLOCK_CO=config.block_co, BLOCK_T=config.block_t, BLOCK_CI=config.block_ci,
                       num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def conv_flops(w_shape, out_shape) -> int:
    """Multiply-adds of the conv (what ``FlopCounterMode`` counts for cuDNN's), so the bench's FLOP count and compute
    ceiling do not depend on the form a conv runs in."""
    c_out, c_in, ksize = w_shape
    return 2 * out_shape[0] * c_out * out_shape[2] * c_in * ksize


def register_conv_op(name: str, launch, tile: type):
    """Register ``code2wav::<name>``, a conv op of this form (this module's, ``conv_gemm_cl``'s, ``conv_gemm_tma``'s):
    ``op(x, weight, bias, dilation, alpha, beta, log_params, config) -> y`` ``[B, C_out, T]`` (``x`` ``[B, C_in,
    P + T]``, ``weight`` ``[C_out, C_in, K]``, ``bias`` ``[C_out]`` or None, ``alpha``/``beta`` ``[C_out]`` the Snake
    after the conv, ``alpha`` None: none; ``config`` a ``tile``'s fields). CUDA tensors run ``launch(x, weight, bias,
    dilation, alpha, beta, log_params, tile(*config))`` (None: the module's Triton is missing); the CPU and the rest
    run ``reference``, contiguous. Its meta output and FLOP count (``conv_flops``) are registered too."""

    def op(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
           beta: Tensor | None, log_params: bool, config: list[int]) -> Tensor:
        check_shapes(x, weight, bias, dilation)
        if x.is_cuda and launch is not None:
            return launch(x, weight, bias, dilation, alpha, beta, log_params, tile(*config))
        return reference(x, weight, bias, dilation, alpha, beta, log_params).contiguous()

    def fake(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
             beta: Tensor | None, log_params: bool, config: list[int]) -> Tensor:
        check_shapes(x, weight, bias, dilation)
        return x.new_empty((x.shape[0], weight.shape[0], x.shape[2] - (weight.shape[2] - 1) * dilation))

    op.__name__ = op.__qualname__ = name
    registered = torch.library.custom_op(f"code2wav::{name}", op, mutates_args=())
    registered.register_fake(fake)
    register_flop_formula(getattr(torch.ops.code2wav, name))(
        lambda x_shape, w_shape, *args, out_shape=None, **kwargs: conv_flops(w_shape, out_shape))
    return registered


conv_snake = register_conv_op("conv_snake", _launch if triton is not None else None, ConvGemmTile)
"""``code2wav::conv_snake``: ``x`` in any strides, ``weight`` in any strides (``kernel_weight`` gives the layout the
kernel reads best), ``config`` a ``ConvGemmTile``'s fields."""


def kernel_weight(weight: Tensor) -> Tensor:
    """``weight`` ``[C_out, C_in, K]`` stored tap-major (``[K, C_out, C_in]`` in memory, returned as a
    ``[C_out, C_in, K]`` view): each tap's ``[C_out, C_in]`` matrix is then contiguous for the kernel's tiles."""
    return weight.detach().permute(2, 0, 1).contiguous().permute(1, 2, 0)


def run_interpreted(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, alpha: Tensor | None,
                    beta: Tensor | None, log_params: bool,
                    config: ConvGemmTile = ConvGemmTile(16, 32, 16, 1, 1)) -> Tensor:
    """The Triton kernel on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton was
    imported), for the CPU tests (small tiles: many programs, partial tiles at every edge)."""
    check_shapes(x, weight, bias, dilation)
    return _launch(x, weight, bias, dilation, alpha, beta, log_params, config)
