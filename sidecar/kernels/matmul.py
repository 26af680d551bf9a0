"""Float32 GEMMs on tensor cores at float32 accuracy (3xTF32), and which form each GEMM shape runs in.

Rules:
- What it computes: ``out = a @ b (+ bias) (+ out when accumulate)``, ``a`` ``[M, K]``, ``b`` ``[K, N]``, ``out``
  ``[M, N]`` (any strides), ``bias`` ``[P]`` with ``N % P == 0`` read as ``bias[n % P]`` (a transposed conv's
  ``s`` output phases share one bias). Float32 accumulation.
- How (``code2wav::mm_3xtf32_``): each operand is split as ``hi + lo``, ``hi = tf32(x)``, ``lo = x - hi``, and the
  product is ``hi_a hi_b + hi_a lo_b + lo_a hi_b`` on TF32 tensor cores (Triton's ``input_precision="tf32x3"``):
  about float32's rounding (the dropped ``lo_a lo_b`` is 2^-22 of a product), where one TF32 pass keeps 10 bits.
  ``tests/test_matmul.py`` holds it to float32 cuBLAS's error against float64 on the GPU.
- Why: with TF32 off (the float32 promise), cuBLAS runs float32 GEMMs on the SIMT units (about 67 TFLOP/s on the
  H200, against 495 for TF32 tensor cores). The 48 kHz family's float32 step at 64 x 25 frames spent 26.5 of its
  40 ms in them (``code2wav-sidecar profile``): its transposed convs (``transposed.py``) and residual units'
  1x1 convs are GEMMs.
- Which form runs is ``matmul_choice.py``'s policy (measured per shape); this module is the mechanism.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula


try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


class MatmulTile(NamedTuple):
    """A tile shape and launch setting of the kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


CONFIGS = (
    MatmulTile(128, 128, 32, 8, 3),
    MatmulTile(128, 64, 32, 4, 4),
    MatmulTile(128, 32, 32, 4, 4),
)
"""Candidates (rows x columns per tile, depth per step, warps, pipeline stages); float32 tiles take twice the shared
memory of bf16 ones, so the depth is 32."""
GROUP_M = 8
"""Row tiles that walk the column tiles together (their ``b`` tiles stay in L2)."""


def check_shapes(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None) -> None:
    if a.dim() != 2 or b.dim() != 2 or out.dim() != 2 or a.shape[1] != b.shape[0] or \
            out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"mm_3xtf32_ needs out [M, N], a [M, K], b [K, N], got out {tuple(out.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.numel() == 0 or b.shape[1] % bias.numel()):
        raise ValueError(f"mm_3xtf32_: the bias must be [P] with P dividing N = {b.shape[1]}, got "
                         f"{tuple(bias.shape)}")
    depth, num_cols = b.shape
    # the kernel offsets rows in int64 and everything else in int32 (what a decoder's GEMMs need)
    offsets = {"a's columns": (depth - 1) * abs(a.stride(1)),
               "b": (depth - 1) * abs(b.stride(0)) + (num_cols - 1) * abs(b.stride(1)),
               "out's columns": (num_cols - 1) * abs(out.stride(1))}
    too_far = [name for name, offset in offsets.items() if offset >= 2 ** 31]
    if too_far:
        raise ValueError(f"mm_3xtf32_: offsets within {', '.join(too_far)} reach 2^31 elements; make the rows "
                         f"contiguous (a.contiguous(), a contiguous out) or use torch.mm")


def reference(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, accumulate: bool) -> None:
    """The torch expression (CPU implementation; what the kernel is tested against), written into ``out``."""
    y = a @ b  # [M, N]
    if bias is not None:
        y = y + bias.repeat(b.shape[1] // bias.numel())  # [M, N]
    if accumulate:
        out.add_(y)
    else:
        out.copy_(y)


if triton is not None:
    @triton.jit
    def _mm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, num_rows, num_cols, depth, bias_period,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(num_rows, BLOCK_M)
        tiles_n = tl.cdiv(num_cols, BLOCK_N)
        per_group = GROUP * tiles_n
        first_m = (pid // per_group) * GROUP
        group_rows = tl.minimum(tiles_m - first_m, GROUP)
        tile_m = first_m + (pid % per_group) % group_rows
        tile_n = (pid % per_group) // group_rows
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        row_in = rows < num_rows
        col_in = cols < num_cols
        a_at = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
        b_off = ks[:, None] * stride_bk + cols[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, depth, BLOCK_K):
            if EVEN_K:
                a_mask = row_in[:, None]
                b_mask = col_in[None, :]
            else:
                k_in = ks < depth - k0
                a_mask = row_in[:, None] & k_in[None, :]
                b_mask = k_in[:, None] & col_in[None, :]
            a = tl.load(a_at, mask=a_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
            b = tl.load(b_ptr + b_off, mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, b, acc, input_precision="tf32x3")  # both split into TF32 hi + lo, three products
            a_at += BLOCK_K * stride_ak
            b_off += BLOCK_K * stride_bk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols % bias_period, mask=col_in, other=0.0)[None, :]
        c_at = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn  # [BLOCK_M, BLOCK_N]
        in_tile = row_in[:, None] & col_in[None, :]
        if ACCUMULATE:
            acc += tl.load(c_at, mask=in_tile, other=0.0)
        tl.store(c_at, acc, mask=in_tile)


def _launch(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, accumulate: bool, config: MatmulTile) -> None:
    num_rows, depth = a.shape
    num_cols = b.shape[1]
    if out.numel() == 0:
        return
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(num_cols, config.block_n),)
    _mm_kernel[grid](a, b, b if bias is None else bias, out, num_rows, num_cols, depth,
                     1 if bias is None else bias.numel(), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                     out.stride(0), out.stride(1), HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
                     EVEN_K=depth % config.block_k == 0, GROUP=GROUP_M, BLOCK_M=config.block_m,
                     BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                     num_stages=config.num_stages)


@torch.library.custom_op("code2wav::mm_3xtf32_", mutates_args=("out",))
def mm_3xtf32_(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, accumulate: bool, config: list[int]) -> None:
    """``out = a @ b (+ bias) (+ out when accumulate)`` in float32 (the module docstring); ``config`` the five
    fields of a ``MatmulTile`` (CUDA), ignored on CPU."""
    check_shapes(out, a, b, bias)
    if a.is_cuda and triton is not None:
        if not (a.dtype == b.dtype == out.dtype == torch.float32):
            raise ValueError(f"mm_3xtf32_ is for float32 tensors, got {a.dtype}, {b.dtype}, {out.dtype}")
        _launch(out, a, b, bias, accumulate, MatmulTile(*config))
        return
    reference(out, a, b, bias, accumulate)


@mm_3xtf32_.register_fake
def _(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, accumulate: bool, config: list[int]) -> None:
    check_shapes(out, a, b, bias)


@register_flop_formula(torch.ops.code2wav.mm_3xtf32_)
def _flops(dest_shape, a_shape, b_shape, *args, **kwargs) -> int:
    """Multiply-adds of the GEMM, as ``FlopCounterMode`` counts cuBLAS's (the bench's FLOP count does not depend on
    the form). (``out_shape``, the op's return, is passed by keyword: here None.)"""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def run_interpreted(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, accumulate: bool,
                    config: MatmulTile = MatmulTile(16, 16, 16, 1, 1)) -> None:
    """The Triton kernel on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton was
    imported), for the CPU tests (small tiles: many programs, partial tiles at every edge)."""
    check_shapes(out, a, b, bias)
    _launch(out, a, b, bias, accumulate, config)
