"""Snake activation fused with the causal conv's state concatenation: one Triton kernel instead of about ten.

What it computes, for ``x`` ``[B, C, T]``, per-channel parameters and an optional state ``[B, C, P]``:

- ``y = x + inv * sin(x * scale)^2`` with, per channel ``c``, ``scale = exp(alpha_c)`` and
  ``inv = 1 / (exp(beta_c) + 1e-9)`` (SnakeBeta, ``LOG_PARAMS``), or ``scale = alpha_c`` and
  ``inv = 1 / (alpha_c + 1e-9)`` (Snake, the parameters used as they are);
- ``cat = [state, y]`` ``[B, C, P + T]`` (the stateful conv's input);
- optionally, ``x + in_bias`` in place of ``x`` (biases still pending on ``x``: ``pending.py``);
- ``tail[b] = cat[b, :, len_b : len_b + P]`` ``[B, C, P]`` (the state the next chunk needs: the ``P`` columns
  that end at row ``b``'s last valid step, ``len_b`` from ``lengths``), what ``cat_with_tail`` computes.

Written with torch ops, that is ``mul, sin, square, mul, add`` (each a full pass over the largest tensors of the
decoder), a ``cat`` and a gather: about ten kernels and as many passes over memory. Here it is one read of ``x``,
one write of ``cat``, with the math in float32 and one rounding to the output dtype. Rows, channels and column
blocks are the grid; each program loads its channel's two parameters once.

``snake_cat`` is registered as the torch library op ``code2wav::snake_cat`` (CUDA: the Triton kernel; CPU and
meta: the torch expression), so eager steps and CUDA graph capture call it like any op and profiles name it.
Under ``torch.compile`` a decoder keeps its torch expression instead (Inductor fuses it with its neighbours);
each family's ``use_fused_kernels`` switches its Snake modules to this op. Triton is optional: without it
``available()`` is False and the decoder keeps its torch expression everywhere.

The launcher picks, per call, the kernel (``snake_kernels.py``: a channel row per program, or tiles for
channels-last inputs and outputs and ``transposed.py``'s frame pairs, where a state program of its own writes the
state columns and the tail), the tiled kernel's tile (``tile_for``) and the sine (``snake_math.sine_for``). Snake's
maths itself (the torch expression, and the Triton device functions every kernel that applies Snake shares) is
``snake_math.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # the CPU wheel of torch does not need Triton; the CUDA wheel ships it
    import triton
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_kernels import _snake_cat_kernel, _snake_cat_tile_kernel

from .snake_math import activate, sine_for

BLOCK_COLS = 1024
"""Columns per program: a multiple of the warp size that keeps short chunks (a few hundred samples) one program."""


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable)."""
    return triton is not None


def set_fused(module: torch.nn.Module, activation: type, enabled: bool) -> bool:
    """Set ``fused`` on every ``activation`` module (a family's Snake class) under ``module``: the conv after it
    then calls this kernel on CUDA tensors. Returns whether the kernel is in use (False without Triton)."""
    fused = enabled and available()
    for sub in module.modules():
        if isinstance(sub, activation):
            sub.fused = fused
    return fused


def reference(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
              log_params: bool) -> tuple[Tensor, Tensor]:
    """The torch expression of ``snake_cat`` in ``x``'s dtype (the CPU and meta implementation, and what the
    CUDA kernel is tested against). Returns ``(cat [B, C, P + T], tail [B, C, P])``."""
    y = activate(x, alpha, beta, log_params)  # [B, C, T]
    if state is None:
        return y, y.new_empty((x.shape[0], x.shape[1], 0))
    if lengths is None:
        raise ValueError("snake_cat with a state needs lengths (where each row's tail ends)")
    return cat_with_tail(y, state, lengths)


def cat_with_tail(y: Tensor, state: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``(cat([state, y]) [B, C, P + T], tail [B, C, P])`` in ``y``'s dtype: the tail is the ``P`` columns of the cat
    that end at each row's last valid column of ``y`` (``lengths``). The torch expression of ``snake_cat``'s and
    ``state_cat``'s bookkeeping."""
    cat = torch.cat([state.to(y.dtype), y], dim=2)  # [B, C, P + T]
    num_cols = state.shape[2]
    index = lengths.to(y.device)[:, None] + torch.arange(num_cols, device=y.device)[None, :]  # [B, P]
    tail = torch.gather(cat, 2, index[:, None, :].expand(y.shape[0], y.shape[1], num_cols))  # [B, C, P]
    return cat, tail


TILE_ELEMENTS = 4096
"""Elements per program of the tiled kernel (``tile_for``): 32 per thread at four warps."""

STATE_COLS = 8
"""State columns per piece of the tiled kernel's state program (``_state_and_tail``): a ``[64, 8]`` piece holds 4
elements per thread at four warps, well under a tile's 32, so the state program never sets the kernel's registers."""


def state_cols_for(num_state_cols: int) -> int:
    """State columns per piece of the tiled kernel's state program (``BLOCK_P``): ``STATE_COLS``, or the next power
    of two of a smaller state (a transposed conv's one frame: 1). Pure."""
    return min(1 << max(num_state_cols - 1, 0).bit_length(), STATE_COLS)


def tile_for(num_channels: int) -> tuple[int, int]:
    """``(channels, columns)`` per program of the tiled kernel: 64 channels (fewer where ``num_channels``' next power
    of two is less) and columns to fill ``TILE_ELEMENTS``. Measured per kind of call on the H200
    (bf16, 64 x 25 frames; docs/design-notes.md, "Batch 64: Snake tiles"): 64 x 64 was the fastest or
    within 3% of it for ``snake_cat`` and the pairs. Pure."""
    block_c = min(1 << max(num_channels - 1, 0).bit_length(), 64)
    return block_c, TILE_ELEMENTS // block_c


def _launch(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
            log_params: bool, in_bias: Tensor | None = None, pairs: bool = False,
            channels_last: bool = False) -> tuple[Tensor, Tensor]:
    """The kernels' launcher: ``(cat [B, C, P + T], tail [B, C, P])`` (``cat`` channels-last with
    ``channels_last``), or with ``pairs``, ``(pairs [B, P + T - 1, 2 * C], tail)`` (``transposed.py``). Where
    ``x``'s columns are contiguous and ``cat`` is not channels-last, the one-channel-per-program kernel; otherwise
    the tiled one, its tile from ``tile_for``; the sine from ``sine_for``."""
    batch, channels, num_cols_in = x.shape
    num_state_cols = 0 if state is None else state.shape[2]
    total = num_state_cols + num_cols_in
    if pairs:
        out = torch.empty((batch, max(total - 1, 0), 2 * channels), dtype=x.dtype, device=x.device)
        out_strides = (out.stride(0), 1, 2 * channels)  # column u of channel c at u * 2C + c
    elif channels_last:
        out = torch.empty((batch, total, channels), dtype=x.dtype, device=x.device).transpose(1, 2)  # [B, C, P + T]
        out_strides = out.stride()
    else:
        out = torch.empty((batch, channels, total), dtype=x.dtype, device=x.device)
        out_strides = out.stride()
    tail = torch.empty((batch, channels, num_state_cols), dtype=x.dtype, device=x.device)  # [B, C, P]
    if out.numel() == 0 and tail.numel() == 0:
        return out, tail
    has_state = state is not None and num_state_cols > 0
    if has_state and lengths is None:
        raise ValueError("snake_cat with a state needs lengths (where each row's tail ends)")
    src = state if has_state else x  # any valid pointer when there is no state (never read)
    args = (x, src, alpha, beta if log_params else alpha, lengths if has_state else src, out, tail,
            alpha if in_bias is None else in_bias,
            channels, num_cols_in, num_state_cols,
            x.stride(0), x.stride(1), x.stride(2), src.stride(0), src.stride(1), src.stride(2))
    flags = dict(LOG_PARAMS=log_params, HAS_STATE=has_state, HAS_IN_BIAS=in_bias is not None,
                 SINE=sine_for(x))
    if pairs or channels_last or x.stride(2) != 1:
        block_c, block_t = tile_for(channels)
        grid = (triton.cdiv(num_cols_in, block_t) + has_state, triton.cdiv(channels, block_c), batch)  # + the state's
        _snake_cat_tile_kernel[grid](*args, *out_strides, **flags, PAIRS=pairs, BLOCK_C=block_c, BLOCK_T=block_t,
                                     BLOCK_P=state_cols_for(num_state_cols), num_warps=4)
    else:
        grid = (triton.cdiv(total, BLOCK_COLS), channels, batch)
        _snake_cat_kernel[grid](*args, **flags, BLOCK=BLOCK_COLS, num_warps=4)
    return out, tail


@torch.library.custom_op("code2wav::snake_cat", mutates_args=())
def snake_cat(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
              log_params: bool, in_bias: Tensor | None = None, channels_last: bool = False
              ) -> tuple[Tensor, Tensor]:
    """``(cat, tail)``, see the module docstring. ``x`` ``[B, C, T]`` (any strides), ``state`` ``[B, C, P]`` or
    None (then ``cat`` is the activation alone and ``tail`` is empty), ``alpha``/``beta`` ``[C]`` (``beta``
    unused unless ``log_params``), ``lengths`` ``[B]`` int64 valid columns of ``x`` per row (needed with a state
    only: it places the tail; None without one). ``in_bias`` ``[C]``:
    the activation is of ``x + in_bias`` (the bias of the conv that produced ``x``, which then runs without it:
    PyTorch adds a cuDNN conv's bias in a separate full pass over its output). ``channels_last``: ``cat`` with
    its channels contiguous (strides ``(C (P + T), 1, C)``: what cuDNN's NHWC convs read without a conversion)."""
    if x.is_cuda and triton is not None:
        return _launch(x, None if state is None else state.to(x.dtype), alpha, beta, lengths, log_params,
                       in_bias, channels_last=channels_last)
    if in_bias is not None:
        x = x + in_bias[None, :, None]  # [B, C, T]
    cat, tail = reference(x, state, alpha, beta, lengths, log_params)
    return _laid_out(cat, channels_last), tail.contiguous()


def _laid_out(cat: Tensor, channels_last: bool) -> Tensor:
    """``cat`` as a new tensor, contiguous or channels-last (the ops' outputs never alias their inputs)."""
    return cat.transpose(1, 2).contiguous().transpose(1, 2) if channels_last else cat.contiguous()


def _empty_outputs(x: Tensor, state: Tensor | None, channels_last: bool = False) -> tuple[Tensor, Tensor]:
    """The outputs' shapes without computing them (the ops' fake implementations)."""
    num_state_cols = 0 if state is None else state.shape[2]
    cat = _laid_out(x.new_empty((x.shape[0], x.shape[1], num_state_cols + x.shape[2])), channels_last)
    return cat, x.new_empty((x.shape[0], x.shape[1], num_state_cols))  # [B, C, P]


@snake_cat.register_fake
def _(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
      log_params: bool, in_bias: Tensor | None = None, channels_last: bool = False) -> tuple[Tensor, Tensor]:
    return _empty_outputs(x, state, channels_last)


def run_interpreted(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
                    log_params: bool, in_bias: Tensor | None = None,
                    channels_last: bool = False) -> tuple[Tensor, Tensor]:
    """The Triton kernel itself on CPU tensors, under Triton's interpreter (``TRITON_INTERPRET=1`` set before
    Triton was imported): what the CPU tests use to check the kernel's indexing without a GPU."""
    return _launch(x, state, alpha, beta, lengths, log_params, in_bias, channels_last=channels_last)
