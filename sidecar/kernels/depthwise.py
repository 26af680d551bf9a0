"""A depthwise conv (one filter per channel, any dilation), optionally followed by Snake, as one Triton kernel.

What it computes, for ``x`` ``[B, C, P + T]`` (the stateful conv's input, state columns in front, as ``snake_cat``
writes it), ``weight`` ``[C, 1, K]``, ``bias`` ``[C]`` and dilation ``d`` with ``P = (K - 1) * d``:

- ``h[b, c, t] = bias[c] + sum_k weight[c, 0, k] * x[b, c, t + k * d]`` ``[B, C, T]`` (``F.conv1d(..., groups=C)``);
- with Snake parameters: ``y = h + inv * sin(h * scale)^2`` per channel, ``scale``/``inv`` as in ``snake.py``
  (``LOG_PARAMS``: SnakeBeta's ``exp`` form; else the parameters as stored), else ``y = h``;
- float32 math, one rounding to ``x``'s dtype.

Why: PyTorch runs a dilated depthwise ``conv1d`` with its generic depthwise kernel
(``conv_depthwise2d_forward_kernel_generic``), which took about 16 ms of a 64 x 25-frame step of the 2048-wide
latent decoder on the H200, where the conv is a memory-bound pass (seven loads per output that hit the cache, seven
FMAs). The Snake after it is the only reader of ``h`` in a residual unit, so applying it here saves a write and a
read of ``h`` and the Snake kernel's launch. Rows, channels and column blocks are the grid, as in ``snake.py``; for
a channels-last ``x`` (the residual stream after a transposed conv as one GEMM, ``transposed.py``) a second kernel
takes ``[columns, channels]`` tiles and writes ``y`` channels-last, so each tap's load is whole 16-byte vectors (in
a contiguous row a tap starts at any element: Triton loads those one element at a time, which left the bf16 kernel
no faster than the float32 one, 5.7 ms of a 15.4 ms 64 x 25-frame step of the 48 kHz family on the H200).

Registered as ``code2wav::depthwise_snake`` (CUDA: the kernel; CPU and meta: ``F.conv1d`` and the torch
expression of Snake), so CUDA graphs capture it and profiles name it.
"""

from __future__ import annotations

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

BLOCK_COLS = 1024
"""Output columns per program (as ``snake.BLOCK_COLS``)."""


def reference(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor | None, beta: Tensor | None,
              log_params: bool) -> Tensor:
    """The torch expression in ``x``'s dtype (CPU and meta implementation; what the kernel is tested against):
    ``[B, C, T]``."""
    h = F.conv1d(x, weight.to(x.dtype), bias.to(x.dtype), dilation=dilation, groups=x.shape[1])  # [B, C, T]
    return h if alpha is None else activate(h, alpha, beta, log_params)  # [B, C, T]


def shifted_taps(x: Tensor, weight: Tensor, bias: Tensor, dilation: int) -> Tensor:
    """A depthwise ``conv1d`` (``groups == C``, no padding) as ``k`` shifted multiply-adds in torch ops: ``x``
    ``[B, C, P + T]``, ``weight`` ``[C, 1, k]`` -> ``[B, C, T]``: the form a kit ``CausalConv`` takes under
    ``torch.compile``. Eager, it is ``2k`` kernels; compiled, Inductor fuses it with the Snake before it and the state
    ``cat`` into one kernel, where a depthwise ``conv1d`` stays an extern call to PyTorch's generic depthwise kernel
    (on the H200 over half of the compiled bf16 step of the 48 kHz latents family at 64 rows x 25 frames)."""
    kernel_size = weight.shape[2]
    num_out = x.shape[2] - (kernel_size - 1) * dilation
    taps = weight[:, 0, :, None]  # [C, k, 1]
    y = bias[:, None] + taps[:, 0] * x[:, :, :num_out]  # [B, C, T]
    for k in range(1, kernel_size):
        y = y + taps[:, k] * x[:, :, k * dilation:k * dilation + num_out]  # [B, C, T]
    return y


def check_shapes(x: Tensor, weight: Tensor, bias: Tensor, dilation: int) -> None:
    """A depthwise filter per channel, an input at least one receptive field long."""
    channels = x.shape[1]
    if x.dim() != 3 or weight.shape != (channels, 1, weight.shape[2]) or bias.shape != (channels,):
        raise ValueError(f"depthwise_snake needs x [B, C, L], weight [C, 1, K] and bias [C], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, bias {tuple(bias.shape)}")
    if dilation < 1 or x.shape[2] < (weight.shape[2] - 1) * dilation:
        raise ValueError(f"depthwise_snake: dilation {dilation} and kernel size {weight.shape[2]} need at least "
                         f"{(weight.shape[2] - 1) * dilation} input columns, got {x.shape[2]}")


if triton is not None:
    @triton.jit
    def _depthwise_kernel(x_ptr, w_ptr, b_ptr, alpha_ptr, beta_ptr, y_ptr, num_channels, num_cols_out,
                          stride_xb, stride_xc, stride_xt,
                          KSIZE: tl.constexpr, DILATION: tl.constexpr, ACTIVATE: tl.constexpr,
                          LOG_PARAMS: tl.constexpr, SINE: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        c = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        cols = block * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output columns
        inside = cols < num_cols_out
        row = x_ptr + b * stride_xb + c * stride_xc
        acc = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(b_ptr + c).to(tl.float32)
        for k in tl.static_range(KSIZE):  # the taps' loads overlap: after the first, from the cache
            w = tl.load(w_ptr + c * KSIZE + k).to(tl.float32)
            acc += w * tl.load(row + (cols + k * DILATION) * stride_xt, mask=inside, other=0.0).to(tl.float32)
        if ACTIVATE:
            scale, inv = snake_scale_inv(tl.load(alpha_ptr + c).to(tl.float32),
                                         tl.load(beta_ptr + c).to(tl.float32), LOG_PARAMS)
            acc = snake_apply(acc, scale, inv, SINE)
        tl.store(y_ptr + (b * num_channels + c) * num_cols_out + cols, acc.to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _depthwise_cl_kernel(x_ptr, w_ptr, b_ptr, alpha_ptr, beta_ptr, y_ptr, num_channels, num_cols_out,
                             stride_xb, stride_xc, stride_xt,
                             KSIZE: tl.constexpr, DILATION: tl.constexpr, ACTIVATE: tl.constexpr,
                             LOG_PARAMS: tl.constexpr, SINE: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        """``_depthwise_kernel`` for a channels-last ``x`` (``stride_xc == 1``), over ``[BLOCK_T, BLOCK_C]`` tiles,
        writing ``y`` channels-last: tap ``k`` of a tile is the tile ``k * DILATION`` columns on, ``k * DILATION *
        C`` elements away, so every tap loads whole 16-byte vectors along the channels (where a channel row's taps
        start at any element and load one element per instruction)."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] output columns
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        b = tl.program_id(2).to(tl.int64)
        c_in = c < num_channels
        inside = (t < num_cols_out)[:, None] & c_in[None, :]  # [BLOCK_T, BLOCK_C]
        at = x_ptr + b * stride_xb + t[:, None] * stride_xt + c[None, :] * stride_xc
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + \
            tl.load(b_ptr + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
        for k in tl.static_range(KSIZE):  # as above, the taps' tiles overlap: after the first, from the cache
            w = tl.load(w_ptr + c * KSIZE + k, mask=c_in, other=0.0).to(tl.float32)  # [BLOCK_C]
            acc += w[None, :] * tl.load(at + k * DILATION * stride_xt, mask=inside, other=0.0).to(tl.float32)
        if ACTIVATE:
            scale, inv = snake_scale_inv(tl.load(alpha_ptr + c, mask=c_in, other=1.0).to(tl.float32),
                                         tl.load(beta_ptr + c, mask=c_in, other=0.0).to(tl.float32), LOG_PARAMS)
            acc = snake_apply(acc, scale[None, :], inv[None, :], SINE)
        y_at = y_ptr + b * num_cols_out * num_channels + t[:, None] * num_channels + c[None, :]  # [B, T, C]
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=inside)


BLOCK_CL = (64, 64)
"""``(columns, channels)`` per program of the channels-last kernel (fewer channels where the tensor has fewer)."""


def channels_last(x: Tensor) -> bool:
    """Whether ``x`` ``[B, C, L]`` has its channels contiguous (the layout of a residual stream after a transposed
    conv as one GEMM, ``transposed.py``): then the output is channels-last too, on every device."""
    return x.shape[1] > 1 and x.stride(1) == 1


def _empty_output(x: Tensor, num_cols_out: int) -> Tensor:
    """``y`` ``[B, C, T]`` laid out as ``x`` (channels-last or contiguous)."""
    batch, channels, _ = x.shape
    if channels_last(x):
        return x.new_empty((batch, num_cols_out, channels)).transpose(1, 2)  # [B, C, T], channels contiguous
    return x.new_empty((batch, channels, num_cols_out))  # [B, C, T]


def _launch(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor | None, beta: Tensor | None,
            log_params: bool) -> Tensor:
    batch, channels, num_cols_in = x.shape
    ksize = weight.shape[2]
    num_cols_out = num_cols_in - (ksize - 1) * dilation
    y = _empty_output(x, num_cols_out)  # [B, C, T]
    if y.numel() == 0:
        return y
    has_act = alpha is not None
    params = alpha if has_act else bias  # any valid pointer when there is no Snake (never read)
    args = (x, weight.contiguous(), bias, params, beta if log_params and has_act else params, y,
            channels, num_cols_out, x.stride(0), x.stride(1), x.stride(2))
    flags = dict(KSIZE=ksize, DILATION=dilation, ACTIVATE=has_act, LOG_PARAMS=log_params, SINE=sine_for(x),
                 num_warps=4)
    if channels_last(x):
        block_t, block_c = BLOCK_CL[0], min(BLOCK_CL[1], triton.next_power_of_2(channels))
        grid = (triton.cdiv(num_cols_out, block_t), triton.cdiv(channels, block_c), batch)
        _depthwise_cl_kernel[grid](*args, **flags, BLOCK_T=block_t, BLOCK_C=block_c)
    else:
        grid = (triton.cdiv(num_cols_out, BLOCK_COLS), channels, batch)
        _depthwise_kernel[grid](*args, **flags, BLOCK=BLOCK_COLS)
    return y


@torch.library.custom_op("code2wav::depthwise_snake", mutates_args=())
def depthwise_snake(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor | None,
                    beta: Tensor | None, log_params: bool) -> Tensor:
    """``y`` ``[B, C, T]`` (channels-last where ``x`` is, else contiguous), see the module docstring: ``x``
    ``[B, C, P + T]`` (any strides), ``weight`` ``[C, 1, K]``, ``bias`` ``[C]``; ``alpha``/``beta`` ``[C]`` the
    Snake after the conv (``alpha`` None: none; ``beta`` unused unless ``log_params``)."""
    check_shapes(x, weight, bias, dilation)
    if x.is_cuda and triton is not None:
        return _launch(x, weight, bias, dilation, alpha, beta, log_params)
    y = reference(x, weight, bias, dilation, alpha, beta, log_params)  # [B, C, T]
    return _empty_output(x, y.shape[2]).copy_(y)  # laid out as the kernels write it


@depthwise_snake.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor | None, beta: Tensor | None,
      log_params: bool) -> Tensor:
    check_shapes(x, weight, bias, dilation)
    return _empty_output(x, x.shape[2] - (weight.shape[2] - 1) * dilation)  # [B, C, T]



@register_flop_formula(torch.ops.code2wav.depthwise_snake)
def _flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """Multiply-adds of the depthwise conv, as ``FlopCounterMode`` counts a grouped conv."""
    return 2 * out_shape[0] * out_shape[1] * out_shape[2] * w_shape[2]

def run_interpreted(x: Tensor, weight: Tensor, bias: Tensor, dilation: int, alpha: Tensor | None,
                    beta: Tensor | None, log_params: bool) -> Tensor:
    """The Triton kernel itself on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton
    was imported), for the CPU tests."""
    return _launch(x, weight, bias, dilation, alpha, beta, log_params)
