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

The launcher picks, per call, the tiled kernel's tile (``tile_for``) and the sine (``snake_math.sine_for``); with
a state, the tiled kernel writes the state columns and the tail from a program of their own
(``_snake_cat_tile_kernel``). Snake's maths itself (the torch expression, and the Triton device functions every
kernel that applies Snake shares) is ``snake_math.py``.

Over 300 lines: one computation in two kernels (a channel row per program, and tiles for channels-last inputs and
outputs and ``transposed.py``'s frame pairs, with its state program), their one launcher and its tile choice, and
the op with its CPU expression.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # the CPU wheel of torch does not need Triton; the CUDA wheel ships it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_math import snake_apply, snake_scale_inv

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


if triton is not None:
    @triton.jit
    def _snake_cat_kernel(x_ptr, state_ptr, alpha_ptr, beta_ptr, lengths_ptr, cat_ptr, tail_ptr,
                          in_bias_ptr, num_channels, num_cols_in, num_state_cols,
                          stride_xb, stride_xc, stride_xt, stride_sb, stride_sc, stride_st,
                          LOG_PARAMS: tl.constexpr, HAS_STATE: tl.constexpr,
                          HAS_IN_BIAS: tl.constexpr, SINE: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        c = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        total = num_cols_in + num_state_cols
        cols = block * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] columns of cat
        inside = cols < total
        scale, inv = snake_scale_inv(tl.load(alpha_ptr + c).to(tl.float32), tl.load(beta_ptr + c).to(tl.float32),
                                     LOG_PARAMS)
        is_new = inside & (cols >= num_state_cols)
        x_at = x_ptr + b * stride_xb + c * stride_xc + (cols - num_state_cols) * stride_xt
        x = tl.load(x_at, mask=is_new, other=0.0).to(tl.float32)
        if HAS_IN_BIAS:  # the pending biases, added here instead of in a pass of their own (not rounded)
            x = x + tl.load(in_bias_ptr + c).to(tl.float32)
        y = snake_apply(x, scale, inv, SINE)
        row = (b * num_channels + c) * total
        if HAS_STATE:  # only the blocks that hold state columns or the new tail do this part
            first = block * BLOCK
            if first < num_state_cols:
                old = tl.load(state_ptr + b * stride_sb + c * stride_sc + cols * stride_st,
                              mask=inside & (cols < num_state_cols), other=0.0).to(tl.float32)
                y = tl.where(cols < num_state_cols, old, y)
            length = tl.load(lengths_ptr + b)
            if (first < length + num_state_cols) & (first + BLOCK > length):
                k = cols - length  # column of the new state
                in_tail = inside & (k >= 0) & (k < num_state_cols)
                tl.store(tail_ptr + (b * num_channels + c) * num_state_cols + k,
                         y.to(tail_ptr.dtype.element_ty), mask=in_tail)
        tl.store(cat_ptr + row + cols, y.to(cat_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _snake_cat_tile_kernel(x_ptr, state_ptr, alpha_ptr, beta_ptr, lengths_ptr, out_ptr, tail_ptr,
                               in_bias_ptr, num_channels, num_cols_in, num_state_cols,
                               stride_xb, stride_xc, stride_xt, stride_sb, stride_sc, stride_st,
                               stride_ob, stride_oc, stride_ot,
                               LOG_PARAMS: tl.constexpr, HAS_STATE: tl.constexpr,
                               HAS_IN_BIAS: tl.constexpr, SINE: tl.constexpr, PAIRS: tl.constexpr,
                               BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
        """``_snake_cat_kernel`` over ``[BLOCK_C, BLOCK_T]`` tiles, for an ``x`` whose channels are contiguous
        (channels-last) and for the ``PAIRS`` output (``transposed.py``): Triton loads and stores each along its
        contiguous axis (a stride of 1 is specialised) and transposes the tile in between. ``PAIRS``: the output is
        ``[B, P + T - 1, 2, C]``, cat column ``u`` written as tap 0 of frame ``u`` and as tap 1 of frame ``u - 1``.

        ``HAS_STATE``: the tiles cover the columns of ``x`` alone, and one more program per row and channel block
        (the last along axis 0, ``_state_and_tail``) writes the state columns and the tail. Merged into the tiles,
        the state's load and the tail's store, whose contiguous axis is the columns, made Triton lay the whole
        channels-last tile out along the columns: on the H200 those calls ran at about 1 TB/s against 4 TB/s for
        the same call without a state (docs/performance.md)."""
        chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        b = tl.program_id(2).to(tl.int64)
        total = num_cols_in + num_state_cols
        c_in = chans < num_channels
        scale, inv = snake_scale_inv(tl.load(alpha_ptr + chans, mask=c_in, other=1.0).to(tl.float32),
                                     tl.load(beta_ptr + chans, mask=c_in, other=0.0).to(tl.float32), LOG_PARAMS)
        if HAS_IN_BIAS:
            shift = tl.load(in_bias_ptr + chans, mask=c_in, other=0.0).to(tl.float32)
        else:
            shift = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_STATE:
            state_pid = tl.num_programs(0) - 1
        else:
            state_pid = tl.num_programs(0)  # no program
        if tl.program_id(0) == state_pid:
            if HAS_STATE:  # (compiled only then: without a state, lengths_ptr is any pointer, never read)
                _state_and_tail(x_ptr, state_ptr, lengths_ptr, out_ptr, tail_ptr, b, chans, c_in, scale, inv, shift,
                                num_channels, num_state_cols, total, stride_xb, stride_xc, stride_xt,
                                stride_sb, stride_sc, stride_st, stride_ob, stride_oc, stride_ot,
                                SINE=SINE, PAIRS=PAIRS, BLOCK_P=BLOCK_P)
        else:
            cols = num_state_cols + tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] columns of cat
            inside = c_in[:, None] & (cols < total)[None, :]  # [BLOCK_C, BLOCK_T]
            x_at = x_ptr + b * stride_xb + chans[:, None] * stride_xc + (cols - num_state_cols)[None, :] * stride_xt
            x = tl.load(x_at, mask=inside, other=0.0).to(tl.float32) + shift[:, None]
            y = snake_apply(x, scale[:, None], inv[:, None], SINE)
            _store_cat(out_ptr, y.to(out_ptr.dtype.element_ty), b, chans, cols, inside, total, num_channels,
                       stride_ob, stride_oc, stride_ot, PAIRS)

    @triton.jit
    def _store_cat(out_ptr, y, b, chans, cols, inside, total, num_channels, stride_ob, stride_oc, stride_ot,
                   PAIRS: tl.constexpr):
        """Write the cat tile ``y`` ``[BLOCK_C, columns]`` (columns ``cols`` of the cat), or with ``PAIRS`` each
        column ``u`` as tap 0 of frame ``u`` and tap 1 of frame ``u - 1``."""
        out_at = out_ptr + b * stride_ob + chans[:, None] * stride_oc + cols[None, :] * stride_ot
        if PAIRS:
            tl.store(out_at, y, mask=inside & (cols < total - 1)[None, :])  # tap 0 of frame u
            tl.store(out_at + num_channels - stride_ot, y, mask=inside & (cols >= 1)[None, :])  # tap 1 of u - 1
        else:
            tl.store(out_at, y, mask=inside)

    @triton.jit
    def _state_and_tail(x_ptr, state_ptr, lengths_ptr, out_ptr, tail_ptr, b, chans, c_in, scale, inv, shift,
                        num_channels, num_state_cols, total, stride_xb, stride_xc, stride_xt,
                        stride_sb, stride_sc, stride_st, stride_ob, stride_oc, stride_ot,
                        SINE: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr):
        """The state program of ``_snake_cat_tile_kernel``: the cat's first ``P`` columns (the state, as stored) and
        ``tail = cat[:, len : len + P]``, each column from the state or, past it, Snake of ``x`` computed as the
        tiles compute it (so the tail equals the cat's columns bit for bit). ``BLOCK_P`` state columns at a time
        (``STATE_COLS``): the kernel's registers are the most any of its branches needs, so a whole ``P = 54``
        state in one ``[64, 64]`` piece here would slow every tile of the call (on the H200 a dilation-9 unit's
        Snake took twice as long as a dilation-1 unit's, docs/performance.md)."""
        s_row = state_ptr + b * stride_sb + chans[:, None] * stride_sc
        length = tl.load(lengths_ptr + b)
        for first in range(0, num_state_cols, BLOCK_P):
            k = first + tl.arange(0, BLOCK_P)  # [BLOCK_P] state columns
            keep = c_in[:, None] & (k < num_state_cols)[None, :]  # [BLOCK_C, BLOCK_P]
            old = tl.load(s_row + k[None, :] * stride_st, mask=keep, other=0.0)
            _store_cat(out_ptr, old.to(out_ptr.dtype.element_ty), b, chans, k, keep, total, num_channels,
                       stride_ob, stride_oc, stride_ot, PAIRS)
            u = length + k  # [BLOCK_P] cat columns of the tail
            from_state = (u < num_state_cols)[None, :]
            tail_old = tl.load(s_row + u[None, :] * stride_st, mask=keep & from_state, other=0.0).to(tl.float32)
            x_at = x_ptr + b * stride_xb + chans[:, None] * stride_xc + (u - num_state_cols)[None, :] * stride_xt
            x = tl.load(x_at, mask=keep & (u >= num_state_cols)[None, :], other=0.0).to(tl.float32) + shift[:, None]
            y = snake_apply(x, scale[:, None], inv[:, None], SINE).to(tail_ptr.dtype.element_ty)
            tail = tl.where(from_state, tail_old.to(tail_ptr.dtype.element_ty), y)
            tl.store(tail_ptr + (b * num_channels + chans[:, None]) * num_state_cols + k[None, :], tail, mask=keep)


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
    (``loadgen/probes/snake_tiles.py``, bf16, 64 x 25 frames, docs/performance.md): 64 x 64 was the fastest or
    within 3% of it for ``snake_cat`` and the pairs. Pure."""
    block_c = min(1 << max(num_channels - 1, 0).bit_length(), 64)
    return block_c, TILE_ELEMENTS // block_c


def _launch(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
            log_params: bool, in_bias: Tensor | None = None, pairs: bool = False, channels_last: bool = False,
            block_tile: tuple[int, int] | None = None, sine: int | None = None,
            num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """The kernels' launcher: ``(cat [B, C, P + T], tail [B, C, P])`` (``cat`` channels-last with
    ``channels_last``), or with ``pairs``, ``(pairs [B, P + T - 1, 2 * C], tail)`` (``transposed.py``). Where
    ``x``'s columns are contiguous and ``cat`` is not channels-last, the one-channel-per-program kernel; otherwise
    the tiled one, its tile from ``tile_for`` unless ``block_tile``, its sine from ``sine_for`` unless ``sine``.
    ``block_tile``, ``sine`` and the tiled kernel's ``num_warps`` for probes that compare them."""
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
                 SINE=sine_for(x) if sine is None else sine)
    if pairs or channels_last or x.stride(2) != 1:
        block_c, block_t = block_tile or tile_for(channels)
        grid = (triton.cdiv(num_cols_in, block_t) + has_state, triton.cdiv(channels, block_c), batch)  # + the state's
        _snake_cat_tile_kernel[grid](*args, *out_strides, **flags, PAIRS=pairs, BLOCK_C=block_c, BLOCK_T=block_t,
                                     BLOCK_P=state_cols_for(num_state_cols),
                                     num_warps=num_warps)
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
