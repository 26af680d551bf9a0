"""A causal conv's input with its state in front, and its next state, as one Triton kernel.

``state_cat(x [B, C, T], state [B, C, P], lengths [B]) -> (x_cat [B, C, P + T], tail [B, C, P])``:
``x_cat = cat([state, x], dim=2)`` in ``x``'s dtype (the state cast to it) and ``tail[b] = x_cat[b, :, len_b :
len_b + P]``, the ``P`` columns that end at row ``b``'s last valid input: the next call's state (``snake.cat_with_tail``).
``lengths`` must lie in ``[0, T]`` (not checked: that would cost a sync). Both outputs contiguous. Pure copies:
the same numbers as the torch form.

Why: where no Snake runs before a stateful conv (``snake_cat`` does the same with the Snake applied), torch runs
this as a ``cat`` and, for the tail, an ``arange``, an ``add`` and a ``gather``: four kernels or more per conv, and
at batch 1 the decoder's step is bound by kernel launches. One program per (block of columns, block of channels,
row) copies its tile of ``x_cat`` and writes the part of the tail that falls in it.

Registered as ``code2wav::state_cat`` (CUDA: the kernel; CPU and meta: the torch expression, ``reference``), so
CUDA graphs capture it and profiles name it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .derived import kernel_forms
from .snake import cat_with_tail

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK_COLS = 64
"""Columns of ``x_cat`` per program."""
BLOCK_CHANNELS = 32
"""Channels per program."""


def reference(x: Tensor, state: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """The torch expression (CPU implementation; what the kernel is tested against): ``(x_cat, tail)``, ``snake_cat``'s
    bookkeeping without the Snake."""
    x_cat, tail = cat_with_tail(x, state, lengths)  # [B, C, P + T], [B, C, P]
    return x_cat.contiguous(), tail


def check_shapes(x: Tensor, state: Tensor, lengths: Tensor) -> None:
    if x.dim() != 3 or state.dim() != 3 or state.shape[:2] != x.shape[:2] or state.shape[2] < 1:
        raise ValueError(f"state_cat needs x [B, C, T] and state [B, C, P] with P >= 1, got {tuple(x.shape)} and "
                         f"{tuple(state.shape)}")
    if lengths.shape != (x.shape[0],):
        raise ValueError(f"state_cat needs lengths [B] = [{x.shape[0]}], got {tuple(lengths.shape)}")


def _empty_outputs(x: Tensor, num_state: int) -> tuple[Tensor, Tensor]:
    batch, channels, num_cols = x.shape
    return (x.new_empty((batch, channels, num_state + num_cols)), x.new_empty((batch, channels, num_state)))


if triton is not None:
    @triton.jit
    def _state_cat_kernel(x_ptr, state_ptr, lengths_ptr, out_ptr, tail_ptr, num_channels, num_cols, num_state,
                          s_xb, s_xc, s_xt, s_sb, s_sc, s_st, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
        u = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] columns of x_cat
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        b = tl.program_id(2).to(tl.int64)
        total = num_state + num_cols
        inside = (c < num_channels)[:, None] & (u < total)[None, :]  # [BLOCK_C, BLOCK_T]
        from_state = (u < num_state)[None, :]
        col = u - num_state  # column of x; < 0: a state column
        old = tl.load(state_ptr + b * s_sb + c[:, None] * s_sc + u[None, :] * s_st, mask=inside & from_state,
                      other=0.0)
        new = tl.load(x_ptr + b * s_xb + c[:, None] * s_xc + col[None, :] * s_xt, mask=inside & (col >= 0)[None, :],
                      other=0.0)
        v = tl.where(from_state, old.to(out_ptr.dtype.element_ty), new.to(out_ptr.dtype.element_ty))
        row = b * num_channels + c[:, None]  # [BLOCK_C, 1]
        tl.store(out_ptr + row * total + u[None, :], v, mask=inside)
        j = u - tl.load(lengths_ptr + b)  # [BLOCK_T] place in the tail
        in_tail = inside & ((j >= 0) & (j < num_state))[None, :]
        tl.store(tail_ptr + row * num_state + j[None, :], v, mask=in_tail)


def _launch(x: Tensor, state: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    batch, channels, num_cols = x.shape
    num_state = state.shape[2]
    x_cat, tail = _empty_outputs(x, num_state)
    if batch == 0 or channels == 0:
        return x_cat, tail
    lengths = lengths.contiguous()
    grid = (triton.cdiv(num_state + num_cols, BLOCK_COLS), triton.cdiv(channels, BLOCK_CHANNELS), batch)
    _state_cat_kernel[grid](x, state, lengths, x_cat, tail, channels, num_cols, num_state, x.stride(0), x.stride(1),
                            x.stride(2), state.stride(0), state.stride(1), state.stride(2), BLOCK_C=BLOCK_CHANNELS,
                            BLOCK_T=BLOCK_COLS, num_warps=4)
    return x_cat, tail


@torch.library.custom_op("code2wav::state_cat", mutates_args=())
def state_cat(x: Tensor, state: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_cat [B, C, P + T], tail [B, C, P])``, see the module docstring."""
    check_shapes(x, state, lengths)
    if x.is_cuda and triton is not None:
        return _launch(x, state, lengths)
    return reference(x, state, lengths)


@state_cat.register_fake
def _(x: Tensor, state: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    check_shapes(x, state, lengths)
    return _empty_outputs(x, state.shape[2])


def join(x: Tensor, state: Tensor, lengths: Tensor, op: bool) -> tuple[Tensor, Tensor]:
    """``(x_cat [B, C, P + T], tail [B, C, P])`` for a stateful conv whose input no fused Snake joined: this op where
    ``op`` (the block's ``kernels_on``) and ``derived.kernel_forms()``, else the torch expression
    (``snake.cat_with_tail``). Both families' blocks join their state through here."""
    if op and kernel_forms():
        return torch.ops.code2wav.state_cat(x, state, lengths)
    return cat_with_tail(x, state, lengths)


def run_interpreted(x: Tensor, state: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """The Triton kernel itself on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton
    was imported), for the CPU tests."""
    return _launch(x, state, lengths)
