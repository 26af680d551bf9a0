"""Snake's maths, shared by every kernel that applies it: the torch expression, the Triton device functions, and
which sine a call takes.

``y = x + inv * sin(x * scale)^2`` with, per channel ``c``, ``scale = exp(alpha_c)`` and ``inv = 1 / (exp(beta_c)
+ 1e-9)`` (SnakeBeta, ``log_params``), or ``scale = alpha_c`` and ``inv = 1 / (alpha_c + 1e-9)`` (Snake, the
parameters used as they are). ``activate`` is the torch expression (the kernels' CPU implementations apply it);
``snake_scale_inv`` and ``snake_apply`` are what the kernels of ``snake.py``, ``snake_conv.py``, ``depthwise.py``
and ``conv_gemm.py`` call, with the sine ``sine_for`` picks for their activations.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


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


def sine_for(x: Tensor) -> int:
    """The sine (``snake_apply``'s ``SINE``) for activations ``x``: the hardware's ``sin.approx`` (2) for 16-bit
    CUDA tensors, ``sin_squared`` (1) otherwise. ``sin.approx``'s absolute error (about ``2^-21`` plus ``|z| *
    2^-22``) stays far below half a bf16 or fp16 unit of the activation it feeds (``2^-9`` of it and more), and it
    cuts the Snake kernels' instructions: on the H200 the bf16 step's Snake calls took 15-30% less with it
    (docs/performance.md). float32 keeps ``sin_squared``, as accurate as ``sinf``. Triton's interpreter (CPU tensors)
    cannot run the inline instruction."""
    return 2 if x.is_cuda and x.element_size() == 2 else SINE


SINE = 1
"""The sine of float32 activations (``sine_for``; ``snake_apply``'s ``SINE``): ``sin_squared``, as accurate as
float32 ``sinf`` where activations live and about a third of its code."""


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
    def sin_squared(z):
        """``sin(z)^2`` in float32 without libdevice's ``sinf``: ``k = round(z * 2 / pi)``, ``r = z - k pi / 2`` by
        three FMAs with ``pi / 2`` split in three float32 parts, then ``sin(r)^2`` (``k`` even) or ``1 - sin(r)^2``
        (``k`` odd) with ``sin(r)`` from its Taylor series to ``r^9`` (``|r| <= pi / 4``: the next term is below
        ``2e-9``). Within ``2.5e-7`` of the exact value for ``|z| < 2^20`` (float32 ``sinf`` squared: ``1.3e-7``);
        beyond, clamped to ``[0, 1]``; NaN for NaN and the infinities. About a third of ``sinf``'s code; inside a
        decoder step the Snake kernels took the same time with either (docs/performance.md)."""
        k = tl.floor(z * 0.6366197466850281 + 0.5)  # nearest multiple of pi / 2
        r = tl.fma(-k, 1.5707963705062866, z)
        r = tl.fma(-k, -4.371138828673793e-08, r)
        r = tl.fma(-k, -1.7151245100058819e-15, r)  # [-pi / 4, pi / 4]
        r2 = r * r
        p = tl.fma(r2, 2.7557319223985893e-06, -1.984126984126984e-04)  # 1 / 9!, -1 / 7!
        p = tl.fma(p, r2, 8.333333333333333e-03)  # 1 / 5!
        p = tl.fma(p, r2, -1.6666666666666666e-01)  # -1 / 3!
        s = tl.fma(p * r2, r, r)
        s2 = s * s
        odd = (k - 2.0 * tl.floor(k * 0.5)) != 0.0
        v = tl.maximum(tl.where(odd, 1.0 - s2, s2), 0.0, propagate_nan=tl.PropagateNan.ALL)
        return tl.minimum(v, 1.0, propagate_nan=tl.PropagateNan.ALL)  # NaN and +-inf (r is NaN) give NaN, as sinf

    @triton.jit
    def snake_apply(x, scale, inv, SINE: tl.constexpr):
        """``x + inv * sin(x * scale)^2`` in float32. ``SINE`` (``sine_for``'s; 0 is for
        docs/design-notes.md, "Batch 64: Snake tiles"): 0 libdevice's ``sinf`` squared; 1 ``sin_squared``; 2 the hardware's
        ``sin.approx`` (one MUFU instruction; absolute error about ``2^-21`` plus ``|x * scale| * 2^-22`` from its
        range reduction; not available under Triton's interpreter)."""
        z = x * scale
        if SINE == 1:
            s2 = sin_squared(z)
        elif SINE == 2:
            s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [z], dtype=tl.float32, is_pure=True,
                                          pack=1)
            s2 = s * s
        else:
            s = tl.sin(z)
            s2 = s * s
        return x + inv * s2
