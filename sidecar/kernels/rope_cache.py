"""A sliding-window attention layer's rotary embedding and key/value cache update, as one Triton kernel.

What it computes, from the layer's q/k/v projection ``qkv`` ``[B, T, 3, H, D]`` (one GEMM's output), ``cos`` and
``signed_sin`` ``[B, T, D]`` (the sine's first half negated, so ``rotate_half(x) * sin == swap_halves(x) *
signed_sin``), the cache ``[B, 2, H, P, D]`` (rotated keys, then values, of the ``P`` positions before the chunk)
and ``lengths`` ``[B]`` (valid new positions per row):

- ``q`` ``[B, T, H, D]``: ``x * cos + swap_halves(x) * signed_sin`` of ``qkv[:, :, 0]``;
- ``kv`` ``[B, 2, H, P + T, D]``: the cache, then the new keys (rotated as ``q``) and values;
- ``next_cache`` ``[B, 2, H, P, D]``: ``kv``'s ``P`` positions that end at each row's last valid one
  (``lengths[b] .. lengths[b] + P - 1``). ``lengths`` must lie in ``[0, T]`` (the step's routine clamps them):
  the kernel does not check it (that would cost a sync) and leaves other rows' next cache partly unwritten.

float32 math, one rounding to the output dtype (torch's form rounds the product with ``cos`` first).

Why: at batch 1 the decoder's step is bound by kernel launches, not bytes. In torch ops the same is seven kernels a
layer on CUDA: the swapped halves and the join with the cache are ``cat`` s of strided views, which PyTorch runs as
one copy per input, then the multiply, the multiply-add and the ``gather`` of the next cache. One program per
``(position of kv, row)`` moves ``2 H D`` elements: a cache position is copied, a new one is rotated, and each is
also written to the next cache where it falls in the row's window.

Registered as ``code2wav::rope_kv_cache`` (CUDA: the kernel; CPU and meta: the torch expression, ``reference``), so
CUDA graphs capture it and profiles name it.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def swap_halves(x: Tensor) -> Tensor:
    """``x`` with the two halves of its last dimension swapped."""
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


def reference(qkv: Tensor, cos: Tensor, signed_sin: Tensor, cache: Tensor,
              lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The torch expression (CPU implementation; what the kernel is tested against), float32 math rounded once:
    ``(q [B, T, H, D], kv [B, 2, H, P + T, D], next_cache [B, 2, H, P, D])``, each contiguous."""
    batch, _, _, heads, dim = qkv.shape
    num_cached = cache.shape[3]
    c, s = cos.float()[:, :, None], signed_sin.float()[:, :, None]  # [B, T, 1, D] each

    def rotate(x: Tensor) -> Tensor:  # [B, T, H, D]
        return (x.float() * c + swap_halves(x.float()) * s).to(qkv.dtype)

    q = rotate(qkv[:, :, 0]).contiguous()  # [B, T, H, D]
    kv_new = torch.stack([rotate(qkv[:, :, 1]), qkv[:, :, 2]], dim=1).transpose(2, 3)  # [B, 2, H, T, D]
    kv = torch.cat([cache.to(qkv.dtype), kv_new], dim=3).contiguous()  # [B, 2, H, P + T, D]
    offsets = torch.arange(num_cached, device=qkv.device)  # [P]
    index = (lengths[:, None] + offsets[None, :])[:, None, None, :, None]  # [B, 1, 1, P, 1]
    next_cache = torch.gather(kv, 3, index.expand(batch, 2, heads, num_cached, dim))  # [B, 2, H, P, D]
    return q, kv, next_cache


def check_shapes(qkv: Tensor, cos: Tensor, signed_sin: Tensor, cache: Tensor, lengths: Tensor) -> None:
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[4] % 2:
        raise ValueError(f"rope_kv_cache needs qkv [B, T, 3, H, D] with D even, got {tuple(qkv.shape)}")
    batch, num_new, _, heads, dim = qkv.shape
    if cos.shape != (batch, num_new, dim) or signed_sin.shape != cos.shape:
        raise ValueError(f"rope_kv_cache needs cos and signed_sin [B, T, D] = {(batch, num_new, dim)}, got "
                         f"{tuple(cos.shape)} and {tuple(signed_sin.shape)}")
    if cache.dim() != 5 or cache.shape[:3] != (batch, 2, heads) or cache.shape[4] != dim or cache.shape[3] < 1:
        raise ValueError(f"rope_kv_cache needs cache [B, 2, H, P, D] with P >= 1 and B, H, D of qkv "
                         f"{(batch, heads, dim)}, got {tuple(cache.shape)}")
    if lengths.shape != (batch,):
        raise ValueError(f"rope_kv_cache needs lengths [B] = [{batch}], got {tuple(lengths.shape)}")


def _empty_outputs(qkv: Tensor, num_cached: int) -> tuple[Tensor, Tensor, Tensor]:
    batch, num_new, _, heads, dim = qkv.shape
    return (qkv.new_empty((batch, num_new, heads, dim)), qkv.new_empty((batch, 2, heads, num_cached + num_new, dim)),
            qkv.new_empty((batch, 2, heads, num_cached, dim)))


if triton is not None:
    @triton.jit
    def _rope_kv_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, cache_ptr, lengths_ptr, q_ptr, kv_ptr, next_ptr,
                              num_new, num_cached, num_heads,
                              s_qkv_b, s_qkv_t, s_qkv_3, s_qkv_h, s_rope_b, s_rope_t,
                              s_cache_b, s_cache_2, s_cache_h, s_cache_p,
                              DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        pos = tl.program_id(0)  # position in kv: cache first, then the chunk's
        b = tl.program_id(1).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        inside = (h < num_heads) & (d < DIM)  # [BLOCK_H, BLOCK_D]
        kv_len = num_cached + num_new
        if pos < num_cached:  # a cache position: copied
            at = cache_ptr + b * s_cache_b + h * s_cache_h + pos * s_cache_p + d
            k = tl.load(at, mask=inside).to(kv_ptr.dtype.element_ty)
            v = tl.load(at + s_cache_2, mask=inside).to(kv_ptr.dtype.element_ty)
        else:  # a new position: q and k rotated, v as it is
            t = pos - num_cached
            row = qkv_ptr + b * s_qkv_b + t * s_qkv_t + h * s_qkv_h  # [BLOCK_H, 1] pointers
            swapped = (d + DIM // 2) % DIM  # the other half's element
            rope_at = b * s_rope_b + t * s_rope_t
            c = tl.load(cos_ptr + rope_at + d, mask=d < DIM).to(tl.float32)  # [1, BLOCK_D]
            s = tl.load(sin_ptr + rope_at + d, mask=d < DIM).to(tl.float32)
            q = tl.load(row + d, mask=inside).to(tl.float32) * c + \
                tl.load(row + swapped, mask=inside).to(tl.float32) * s
            q_at = q_ptr + ((b * num_new + t) * num_heads + h) * DIM + d  # [B, T, H, D]
            tl.store(q_at, q.to(q_ptr.dtype.element_ty), mask=inside)
            k = tl.load(row + s_qkv_3 + d, mask=inside).to(tl.float32) * c + \
                tl.load(row + s_qkv_3 + swapped, mask=inside).to(tl.float32) * s
            k = k.to(kv_ptr.dtype.element_ty)
            v = tl.load(row + 2 * s_qkv_3 + d, mask=inside).to(kv_ptr.dtype.element_ty)
        kv_at = kv_ptr + ((b * 2 * num_heads + h) * kv_len + pos) * DIM + d  # [B, 2, H, P + T, D]
        tl.store(kv_at, k, mask=inside)
        tl.store(kv_at + num_heads * kv_len * DIM, v, mask=inside)
        j = pos - tl.load(lengths_ptr + b) + tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64)  # place in the next cache
        in_window = inside & (j >= 0) & (j < num_cached)
        next_at = next_ptr + ((b * 2 * num_heads + h) * num_cached + j) * DIM + d  # [B, 2, H, P, D]
        tl.store(next_at, k, mask=in_window)
        tl.store(next_at + num_heads * num_cached * DIM, v, mask=in_window)


def _launch(qkv: Tensor, cos: Tensor, signed_sin: Tensor, cache: Tensor,
            lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    batch, num_new, _, heads, dim = qkv.shape
    num_cached = cache.shape[3]
    q, kv, next_cache = _empty_outputs(qkv, num_cached)
    if batch == 0:
        return q, kv, next_cache
    if qkv.stride(4) != 1 or cache.stride(4) != 1:  # the kernel reads the last dimension contiguous
        qkv, cache = qkv.contiguous(), cache.contiguous()
    cos, signed_sin, lengths = cos.contiguous(), signed_sin.contiguous(), lengths.contiguous()
    grid = (num_cached + num_new, batch)
    _rope_kv_cache_kernel[grid](qkv, cos, signed_sin, cache, lengths, q, kv, next_cache, num_new, num_cached, heads,
                                qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3), cos.stride(0),
                                cos.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
                                DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
                                num_warps=4)
    return q, kv, next_cache


@torch.library.custom_op("code2wav::rope_kv_cache", mutates_args=())
def rope_kv_cache(qkv: Tensor, cos: Tensor, signed_sin: Tensor, cache: Tensor,
                  lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(q [B, T, H, D], kv [B, 2, H, P + T, D], next_cache [B, 2, H, P, D])``, see the module docstring."""
    check_shapes(qkv, cos, signed_sin, cache, lengths)
    if qkv.is_cuda and triton is not None:
        return _launch(qkv, cos, signed_sin, cache, lengths)
    return reference(qkv, cos, signed_sin, cache, lengths)


@rope_kv_cache.register_fake
def _(qkv: Tensor, cos: Tensor, signed_sin: Tensor, cache: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    check_shapes(qkv, cos, signed_sin, cache, lengths)
    return _empty_outputs(qkv, cache.shape[3])


def run_interpreted(qkv: Tensor, cos: Tensor, signed_sin: Tensor, cache: Tensor,
                    lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton kernel itself on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton
    was imported), for the CPU tests."""
    return _launch(qkv, cos, signed_sin, cache, lengths)
