"""Snake activation fused with the causal conv's state concatenation: one Triton kernel instead of about ten.

What it computes, for ``x`` ``[B, C, T]``, per-channel parameters and an optional state ``[B, C, P]``:

- ``y = x + inv * sin(x * scale)^2`` with, per channel ``c``, ``scale = exp(alpha_c)`` and
  ``inv = 1 / (exp(beta_c) + 1e-9)`` (SnakeBeta, ``LOG_PARAMS``), or ``scale = alpha_c`` and
  ``inv = 1 / (alpha_c + 1e-9)`` (Snake, the parameters used as they are);
- ``cat = [state, y]`` ``[B, C, P + T]`` (the stateful conv's input);
- optionally, ``x + in_bias`` in place of ``x`` (the bias of the conv before, left out of that conv), and
  ``x += in_bias + bias`` written back over ``x`` (``snake_cat_add_bias_``: a residual unit's skip path);
- ``tail[b] = cat[b, :, len_b : len_b + P]`` ``[B, C, P]`` (the state the next chunk needs: the ``P`` columns
  that end at row ``b``'s last valid step, ``len_b`` from ``lengths``), what ``gather_tail`` computes.

Written with torch ops, that is ``mul, sin, square, mul, add`` (each a full pass over the largest tensors of the
decoder), a ``cat`` and a gather: about ten kernels and as many passes over memory. Here it is one read of ``x``,
one write of ``cat``, with the math in float32 and one rounding to the output dtype. Rows, channels and column
blocks are the grid; each program loads its channel's two parameters once.

``snake_cat`` is registered as the torch library op ``code2wav::snake_cat`` (CUDA: the Triton kernel; CPU and
meta: the torch expression), so eager steps and CUDA graph capture call it like any op and profiles name it.
Under ``torch.compile`` a decoder keeps its torch expression instead (Inductor fuses it with its neighbours);
each family's ``use_fused_kernels`` switches its Snake modules to this op. Triton is optional: without it
``available()`` is False and the decoder keeps its torch expression everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # the CPU wheel of torch does not need Triton; the CUDA wheel ships it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK_COLS = 1024
"""Columns per program: a multiple of the warp size that keeps short chunks (a few hundred samples) one program."""


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable)."""
    return triton is not None


def folds_biases(act, x: Tensor) -> bool:
    """Whether a family's blocks around ``act`` (a Snake module with ``runs_fused``) take their fused, in-place form:
    conv biases moved into the next kernel (``in_bias``), a residual unit's skip path written over its input
    (``snake_cat_add_bias_``, then ``baddbmm(out=x)``). Where ``act`` runs fused (CUDA, not under ``torch.compile``)
    and autograd is off (in-place writes)."""
    return act.runs_fused(x) and not torch.is_grad_enabled()


def run_chain(layers, x: Tensor, lengths: Tensor, ctx, in_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Run ``layers`` (a family's blocks or residual units, each ``layer(x, lengths, ctx, in_bias=...)``) in order;
    the first gets ``in_bias``, the bias the conv before them left out (``folds_biases``; None: nothing pending)."""
    for layer in layers:
        x, lengths = layer(x, lengths, ctx, in_bias=in_bias)
        in_bias = None
    return x, lengths


def set_fused(module: torch.nn.Module, activation: type, enabled: bool) -> bool:
    """Set ``fused`` on every ``activation`` module (a family's Snake class) under ``module``: the conv after it
    then calls this kernel on CUDA tensors. Returns whether the kernel is in use (False without Triton)."""
    fused = enabled and available()
    for sub in module.modules():
        if isinstance(sub, activation):
            sub.fused = fused
    return fused


def activate(x: Tensor, alpha: Tensor, beta: Tensor | None, log_params: bool) -> Tensor:
    """Snake's torch expression over ``x`` ``[B, C, T]`` with per-channel ``alpha``/``beta`` ``[C]`` (the two
    forms of the module docstring), in ``x``'s dtype: what every kernel's CPU implementation applies."""
    if log_params:
        scale = torch.exp(alpha)[None, :, None]  # [1, C, 1]
        inv = 1.0 / (torch.exp(beta)[None, :, None] + 1e-9)  # [1, C, 1]
    else:
        scale = alpha[None, :, None]  # [1, C, 1]
        inv = 1.0 / (alpha[None, :, None] + 1e-9)  # [1, C, 1]
    return x + inv * torch.sin(x * scale).square()  # [B, C, T]


def reference(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
              log_params: bool) -> tuple[Tensor, Tensor]:
    """The torch expression of ``snake_cat`` in ``x``'s dtype (the CPU and meta implementation, and what the
    CUDA kernel is tested against). Returns ``(cat [B, C, P + T], tail [B, C, P])``."""
    y = activate(x, alpha, beta, log_params)  # [B, C, T]
    if state is None:
        return y, y.new_empty((x.shape[0], x.shape[1], 0))
    if lengths is None:
        raise ValueError("snake_cat with a state needs lengths (where each row's tail ends)")
    cat = torch.cat([state.to(x.dtype), y], dim=2)  # [B, C, P + T]
    num_cols = state.shape[2]
    index = lengths.to(x.device)[:, None] + torch.arange(num_cols, device=x.device)[None, :]  # [B, P]
    tail = torch.gather(cat, 2, index[:, None, :].expand(x.shape[0], x.shape[1], num_cols))  # [B, C, P]
    return cat, tail


if triton is not None:
    @triton.jit
    def snake_scale_inv(a, b, LOG_PARAMS: tl.constexpr):
        """Snake's ``(scale, inv)`` from the loaded float32 parameters ``a`` (alpha) and ``b`` (beta, unused unless
        ``LOG_PARAMS``): ``(e^a, 1 / (e^b + 1e-9))`` (SnakeBeta) or ``(a, 1 / (a + 1e-9))`` (Snake). Every kernel
        of this package that applies Snake calls it (and ``snake_apply``)."""
        if LOG_PARAMS:
            scale = tl.exp(a)
            inv = 1.0 / (tl.exp(b) + 1e-9)
        else:
            scale = a
            inv = 1.0 / (a + 1e-9)
        return scale, inv

    @triton.jit
    def snake_apply(x, scale, inv):
        """``x + inv * sin(x * scale)^2`` in float32."""
        s = tl.sin(x * scale)
        return x + inv * s * s

    @triton.jit
    def _snake_cat_kernel(x_ptr, state_ptr, alpha_ptr, beta_ptr, lengths_ptr, cat_ptr, tail_ptr, bias_ptr,
                          in_bias_ptr, num_channels, num_cols_in, num_state_cols,
                          stride_xb, stride_xc, stride_xt, stride_sb, stride_sc, stride_st,
                          LOG_PARAMS: tl.constexpr, HAS_STATE: tl.constexpr, ADD_BIAS: tl.constexpr,
                          HAS_IN_BIAS: tl.constexpr, BLOCK: tl.constexpr):
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
        if HAS_IN_BIAS:  # the previous conv's bias, added here instead of in a pass of its own (not rounded)
            x = x + tl.load(in_bias_ptr + c).to(tl.float32)
        if ADD_BIAS:  # x += bias[c] in place: a float32 sum, one rounding (the CPU expression rounds per add)
            shifted = x + tl.load(bias_ptr + c).to(tl.float32)
            tl.store(x_at, shifted.to(x_ptr.dtype.element_ty), mask=is_new)
        y = snake_apply(x, scale, inv)
        row = (b * num_channels + c) * total
        if HAS_STATE:
            old = tl.load(state_ptr + b * stride_sb + c * stride_sc + cols * stride_st,
                          mask=inside & (cols < num_state_cols), other=0.0).to(tl.float32)
            y = tl.where(cols < num_state_cols, old, y)
            k = cols - tl.load(lengths_ptr + b)  # column of the new state
            in_tail = inside & (k >= 0) & (k < num_state_cols)
            tl.store(tail_ptr + (b * num_channels + c) * num_state_cols + k,
                     y.to(tail_ptr.dtype.element_ty), mask=in_tail)
        tl.store(cat_ptr + row + cols, y.to(cat_ptr.dtype.element_ty), mask=inside)


def _launch(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
            log_params: bool, bias: Tensor | None = None, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    batch, channels, num_cols_in = x.shape
    num_state_cols = 0 if state is None else state.shape[2]
    cat = torch.empty((batch, channels, num_state_cols + num_cols_in), dtype=x.dtype, device=x.device)
    tail = torch.empty((batch, channels, num_state_cols), dtype=x.dtype, device=x.device)  # [B, C, P]
    if cat.numel() == 0:
        return cat, tail
    has_state = state is not None and num_state_cols > 0
    if has_state and lengths is None:
        raise ValueError("snake_cat with a state needs lengths (where each row's tail ends)")
    src = state if has_state else x  # any valid pointer when there is no state (never read)
    grid = (triton.cdiv(num_state_cols + num_cols_in, BLOCK_COLS), channels, batch)
    _snake_cat_kernel[grid](x, src, alpha, beta if log_params else alpha, lengths if has_state else src, cat, tail,
                            alpha if bias is None else bias, alpha if in_bias is None else in_bias,
                            channels, num_cols_in, num_state_cols,
                            x.stride(0), x.stride(1), x.stride(2), src.stride(0), src.stride(1), src.stride(2),
                            LOG_PARAMS=log_params, HAS_STATE=has_state, ADD_BIAS=bias is not None,
                            HAS_IN_BIAS=in_bias is not None, BLOCK=BLOCK_COLS, num_warps=4)
    return cat, tail


@torch.library.custom_op("code2wav::snake_cat", mutates_args=())
def snake_cat(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
              log_params: bool, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(cat, tail)``, see the module docstring. ``x`` ``[B, C, T]`` (any strides), ``state`` ``[B, C, P]`` or
    None (then ``cat`` is the activation alone and ``tail`` is empty), ``alpha``/``beta`` ``[C]`` (``beta``
    unused unless ``log_params``), ``lengths`` ``[B]`` int64 valid columns of ``x`` per row (needed with a state
    only: it places the tail; None without one). ``in_bias`` ``[C]``:
    the activation is of ``x + in_bias`` (the bias of the conv that produced ``x``, which then runs without it:
    PyTorch adds a cuDNN conv's bias in a separate full pass over its output)."""
    if x.is_cuda and triton is not None:
        return _launch(x, None if state is None else state.to(x.dtype), alpha, beta, lengths, log_params,
                       None, in_bias)
    if in_bias is not None:
        x = x + in_bias[None, :, None]  # [B, C, T]
    cat, tail = reference(x, state, alpha, beta, lengths, log_params)
    return cat.contiguous(), tail.contiguous()


def _empty_outputs(x: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """The outputs' shapes without computing them (the ops' fake implementations)."""
    num_state_cols = 0 if state is None else state.shape[2]
    cat = x.new_empty((x.shape[0], x.shape[1], num_state_cols + x.shape[2]))  # [B, C, P + T]
    return cat, x.new_empty((x.shape[0], x.shape[1], num_state_cols))  # [B, C, P]


@snake_cat.register_fake
def _(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
      log_params: bool, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _empty_outputs(x, state)


@torch.library.custom_op("code2wav::snake_cat_add_bias_", mutates_args=("x",))
def snake_cat_add_bias_(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
                        log_params: bool, bias: Tensor, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``snake_cat`` of ``x`` (plus ``in_bias``, as there), then ``x += in_bias + bias`` in place (``bias``
    ``[C]``), in the same pass: the kernel reads ``x`` anyway, so a residual unit whose skip path needs ``x +
    bias`` (the 1x1 conv's bias, added to the residual before its ``baddbmm``) saves a full read and write of its
    input."""
    if x.is_cuda and triton is not None:
        return _launch(x, None if state is None else state.to(x.dtype), alpha, beta, lengths, log_params, bias,
                       in_bias)
    if in_bias is not None:
        x.add_(in_bias[None, :, None])
    cat, tail = reference(x, state, alpha, beta, lengths, log_params)
    x.add_(bias[None, :, None])
    return cat.contiguous(), tail.contiguous()


@snake_cat_add_bias_.register_fake
def _(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None, log_params: bool,
      bias: Tensor, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _empty_outputs(x, state)


def run_interpreted(x: Tensor, state: Tensor | None, alpha: Tensor, beta: Tensor, lengths: Tensor | None,
                    log_params: bool, bias: Tensor | None = None, in_bias: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """The Triton kernel itself on CPU tensors, under Triton's interpreter (``TRITON_INTERPRET=1`` set before
    Triton was imported): what the CPU tests use to check the kernel's indexing without a GPU. With ``bias``,
    ``x`` is updated in place as ``snake_cat_add_bias_`` does."""
    return _launch(x, state, alpha, beta, lengths, log_params, bias, in_bias)
