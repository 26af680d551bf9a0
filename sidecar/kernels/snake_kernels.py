"""The Triton kernels of ``snake.py``'s ``snake_cat`` and ``transposed.py``'s ``snake_pairs`` (device code only; the
launcher, its tile choice and the ops are ``snake.py``'s, Snake's maths ``snake_math.py``'s).

``_snake_cat_kernel``: one channel row per program, for an ``x`` whose columns are contiguous and a contiguous
``cat``. ``_snake_cat_tile_kernel``: ``[channels, columns]`` tiles, for channels-last inputs and outputs and the
frame pairs, with a state program of its own. (The leading underscores are the names profiles show; kept.)
"""

from __future__ import annotations

try:  # the CPU wheel of torch does not need Triton; the CUDA wheel ships it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
else:
    from .snake_math import snake_apply, snake_scale_inv

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
        (``snake.STATE_COLS``): the kernel's registers are the most any of its branches needs, so a whole ``P = 54``
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
