"""A transformer layer's elementwise steps between its GEMMs, as two Triton kernels.

- ``add_rms_norm(residual [..., C], x [..., C], scale [C], weight [C], eps) -> (h, normed)``: the layer-scaled
  residual add ``h = residual + scale * x`` and the RMS norm after it, ``normed = h * rsqrt(mean(h^2) + eps) *
  weight`` over the last dimension. float32 math; ``h`` is rounded to the activation dtype once and ``normed`` is
  computed from that rounded ``h`` (the torch form norms the tensor it stored), then rounded once.
- ``silu_mul(gate_up [..., 2I]) -> [..., I]``: the MLP's gate, ``silu(gate) * up`` of the two halves of the
  gate/up GEMM's output. float32 math, rounded once (the torch form rounds silu's output first).

Why: at batch 1 the decoder's step is bound by kernel launches, not bytes. In torch ops a layer runs its two
residual adds (``addcmul``) and its two norms as four kernels and its gate as two; here they are two and one. In the
shipped 8-layer transformer that is 24 kernels fewer a step: every residual add but none folded into the norm after
it (the next layer's input norm, or the final one), and every multiply into its silu. One program per row
(``B * T`` rows) holds the whole row for the norm (``C`` = 512 in the shipped config); the gate takes blocks of a
row (``I`` = 1024).

Registered as ``code2wav::add_rms_norm`` and ``code2wav::silu_mul`` (CUDA: the kernels; CPU and meta: the torch
expressions, ``add_rms_norm_reference`` and ``silu_mul_reference``), so CUDA graphs capture them and profiles
name them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

MAX_GATE_BLOCK = 1024
"""Columns of the gate's output one program writes."""


def add_rms_norm_reference(residual: Tensor, x: Tensor, scale: Tensor, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    """The torch expression (CPU implementation; what the kernel is tested against): ``(h, normed)``, contiguous,
    in ``residual``'s dtype."""
    h = (residual.float() + scale.float() * x.float()).to(residual.dtype)  # [..., C]
    h32 = h.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()  # [..., C]
    return h.contiguous(), normed.to(residual.dtype).contiguous()


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    """The torch expression: ``silu(gate) * up`` ``[..., I]`` in float32, rounded once to ``gate_up``'s dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)  # [..., I] each
    return (F.silu(gate) * up).to(gate_up.dtype).contiguous()


def check_norm_shapes(residual: Tensor, x: Tensor, scale: Tensor, weight: Tensor) -> None:
    if residual.dim() < 1 or x.shape != residual.shape:
        raise ValueError(f"add_rms_norm needs residual and x of one shape [..., C], got {tuple(residual.shape)} "
                         f"and {tuple(x.shape)}")
    num_cols = residual.shape[-1]
    if scale.shape != (num_cols,) or weight.shape != (num_cols,):
        raise ValueError(f"add_rms_norm needs scale and weight [C] = [{num_cols}], got {tuple(scale.shape)} and "
                         f"{tuple(weight.shape)}")


def check_gate_shape(gate_up: Tensor) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul needs gate_up [..., 2I] (gate, then up), got {tuple(gate_up.shape)}")


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(residual_ptr, x_ptr, scale_ptr, weight_ptr, h_ptr, normed_ptr, num_cols,
                             EPS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < num_cols
        at = row * num_cols + cols
        residual = tl.load(residual_ptr + at, mask=inside, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        h = (residual + scale * x).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + at, h, mask=inside)
        h32 = h.to(tl.float32)  # the norm reads the stored (rounded) h; padding columns are 0
        rstd = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=0) / num_cols + EPS)
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(normed_ptr + at, (h32 * rstd * weight).to(normed_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, num_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < num_cols
        gate_at = gate_up_ptr + row * 2 * num_cols + cols
        gate = tl.load(gate_at, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_at + num_cols, mask=inside, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * num_cols + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def _launch_norm(residual: Tensor, x: Tensor, scale: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual, x = residual.contiguous(), x.to(residual.dtype).contiguous()
    h, normed = torch.empty_like(residual), torch.empty_like(residual)
    num_cols = residual.shape[-1]
    num_rows = residual.numel() // max(1, num_cols)
    if num_rows == 0 or num_cols == 0:
        return h, normed
    _add_rms_norm_kernel[(num_rows,)](residual, x, scale.contiguous(), weight.contiguous(), h, normed, num_cols,
                                      EPS=float(eps), BLOCK=triton.next_power_of_2(num_cols),
                                      num_warps=4 if num_cols <= 1024 else 8)
    return h, normed


def _launch_gate(gate_up: Tensor) -> Tensor:
    gate_up = gate_up.contiguous()
    num_cols = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], num_cols))
    num_rows = out.numel() // max(1, num_cols)
    if num_rows == 0 or num_cols == 0:
        return out
    block = min(MAX_GATE_BLOCK, triton.next_power_of_2(num_cols))
    _silu_mul_kernel[(num_rows, triton.cdiv(num_cols, block))](gate_up, out, num_cols, BLOCK=block, num_warps=4)
    return out


@torch.library.custom_op("code2wav::add_rms_norm", mutates_args=())
def add_rms_norm(residual: Tensor, x: Tensor, scale: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(h, normed)``, see the module docstring."""
    check_norm_shapes(residual, x, scale, weight)
    if residual.is_cuda and triton is not None:
        return _launch_norm(residual, x, scale, weight, eps)
    return add_rms_norm_reference(residual, x, scale, weight, eps)


@add_rms_norm.register_fake
def _(residual: Tensor, x: Tensor, scale: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    check_norm_shapes(residual, x, scale, weight)
    return torch.empty_like(residual, memory_format=torch.contiguous_format), \
        torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.custom_op("code2wav::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` ``[..., I]``, see the module docstring."""
    check_gate_shape(gate_up)
    if gate_up.is_cuda and triton is not None:
        return _launch_gate(gate_up)
    return silu_mul_reference(gate_up)


@silu_mul.register_fake
def _(gate_up: Tensor) -> Tensor:
    check_gate_shape(gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def run_interpreted_norm(residual: Tensor, x: Tensor, scale: Tensor, weight: Tensor,
                         eps: float) -> tuple[Tensor, Tensor]:
    """The norm kernel itself on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton was
    imported), for the CPU tests."""
    return _launch_norm(residual, x, scale, weight, eps)


def run_interpreted_gate(gate_up: Tensor) -> Tensor:
    """The gate kernel under Triton's interpreter, as ``run_interpreted_norm``."""
    return _launch_gate(gate_up)
