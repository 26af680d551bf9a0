"""What every layer of a sliding-window transformer shares in one step, as one Triton kernel.

For the rows' first new positions ``start_positions`` ``[B]``, their valid new positions ``lengths`` ``[B]``, ``T``
new positions, a window of ``W`` and the rotary inverse frequencies ``inv_freq`` ``[D/2]`` (float32):

- ``cos`` and ``signed_sin`` ``[B, T, D]`` in the activations' dtype: ``angles = position * inv_freq`` in float32,
  both halves alike, and the sine's first half negated (``rotate_half(x) * sin == swap_halves(x) * signed_sin``);
- ``mask`` ``[B, 1, T, W-1+T]`` (bool): query ``i`` sees key ``j`` (the ``W-1`` cached positions, then the new ones)
  when ``i - W < j <= i`` and ``j >= 0``;
- ``cache_index`` ``[B, 1, 1, W-1, 1]`` (int64): the positions in ``[cache, new]`` of the next cache, the ``W-1``
  ending at each row's last valid one.

Why: at batch 1 the decoder's step is bound by kernel launches. In torch ops these take about 28 small kernels per
step (aranges, the powers of theta, the angles, cos, sin, the casts, the mask's comparisons). One program per
``(new position, row)`` writes its row of each.

Registered as ``code2wav::window_inputs`` (CUDA: the kernel; CPU and meta: the torch expressions below, which the
transformer's other forms use), so CUDA graphs capture it and profiles name it.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # optional, as for snake.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK_COLS = 128
"""Mask (and cache index) columns per inner step."""


def inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """``1 / theta ** (2i / D)`` ``[D/2]``, float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim  # [D/2]
    return 1.0 / (theta ** exponents)  # [D/2]


def rotary(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` ``[B, T, D]`` of ``positions`` ``[B, T]``: angles in float32, rounded once to ``dtype``."""
    angles = positions.float()[:, :, None] * inv_freq[None, None, :]  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def signed_sine(sin: Tensor) -> Tensor:
    """``sin`` ``[..., D]`` with its first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # [..., D]


def window_mask(start_positions: Tensor, num_new: int, window: int) -> Tensor:
    """``[B, 1, T, W-1+T]``: query ``i`` sees key ``j`` when ``i - W < j <= i`` and ``j >= 0``; keys are cache then
    new."""
    device = start_positions.device
    num_cached = window - 1
    q_pos = start_positions[:, None] + torch.arange(num_new, device=device)[None, :]  # [B, T]
    k_pos = start_positions[:, None] - num_cached + torch.arange(num_cached + num_new, device=device)[None, :]
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, W-1+T]
    mask = (diff >= 0) & (diff < window) & (k_pos[:, None, :] >= 0)  # [B, T, W-1+T]
    return mask[:, None]  # [B, 1, T, W-1+T]


def cache_index(lengths: Tensor, num_cached: int) -> Tensor:
    """``[B, 1, 1, P, 1]``: the next cache's positions in ``[cache, new]`` (the ``P`` ending at each row's last valid
    one)."""
    offsets = torch.arange(num_cached, device=lengths.device)  # [P]
    return (lengths[:, None] + offsets[None, :])[:, None, None, :, None]  # [B, 1, 1, P, 1]


def reference(start_positions: Tensor, lengths: Tensor, inv_freq: Tensor, num_new: int, window: int,
              dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The torch expressions (CPU implementation; what the kernel is tested against): ``(cos, signed_sin, mask,
    cache_index)``."""
    positions = start_positions[:, None] + torch.arange(num_new, device=start_positions.device)[None, :]  # [B, T]
    cos, sin = rotary(positions, inv_freq, dtype)  # [B, T, D] each
    return (cos, signed_sine(sin), window_mask(start_positions, num_new, window),
            cache_index(lengths, window - 1).contiguous())


def check_shapes(start_positions: Tensor, lengths: Tensor, inv_freq: Tensor, num_new: int, window: int) -> None:
    if start_positions.dim() != 1 or lengths.shape != start_positions.shape:
        raise ValueError(f"window_inputs needs start_positions and lengths [B], got {tuple(start_positions.shape)} "
                         f"and {tuple(lengths.shape)}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or num_new < 1 or window < 1:
        raise ValueError(f"window_inputs needs inv_freq [D/2] float32, num_new >= 1 and window >= 1, got inv_freq "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype}, num_new {num_new}, window {window}")


def _empty_outputs(start_positions: Tensor, inv_freq: Tensor, num_new: int, window: int,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch = start_positions.shape[0]
    dim = 2 * inv_freq.shape[0]
    new = start_positions.new_empty
    return (new((batch, num_new, dim), dtype=dtype), new((batch, num_new, dim), dtype=dtype),
            new((batch, 1, num_new, window - 1 + num_new), dtype=torch.bool),
            new((batch, 1, 1, window - 1, 1), dtype=torch.int64))


if triton is not None:
    @triton.jit
    def _window_inputs_kernel(start_ptr, lengths_ptr, inv_freq_ptr, cos_ptr, sin_ptr, mask_ptr, index_ptr,
                              num_new, window,
                              HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)  # new position
        b = tl.program_id(1).to(tl.int64)
        start = tl.load(start_ptr + b)  # int64
        pos = start + t
        i = tl.arange(0, BLOCK_HALF)
        in_half = i < HALF
        angles = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=in_half, other=0.0)  # [BLOCK_HALF]
        c = tl.cos(angles).to(cos_ptr.dtype.element_ty)
        s = tl.sin(angles)  # negated in float32, then rounded (the same numbers: rounding is symmetric)
        row = (b * num_new + t) * (2 * HALF)  # [B, T, D]
        tl.store(cos_ptr + row + i, c, mask=in_half)
        tl.store(cos_ptr + row + HALF + i, c, mask=in_half)
        tl.store(sin_ptr + row + i, (-s).to(sin_ptr.dtype.element_ty), mask=in_half)
        tl.store(sin_ptr + row + HALF + i, s.to(sin_ptr.dtype.element_ty), mask=in_half)
        num_cached = window - 1
        num_keys = num_cached + num_new
        for k0 in range(0, num_keys, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_pos = start - num_cached + k
            diff = pos - k_pos
            seen = (diff >= 0) & (diff < window) & (k_pos >= 0)
            tl.store(mask_ptr + (b * num_new + t) * num_keys + k, seen, mask=k < num_keys)  # [B, 1, T, W-1+T]
        if t == 0:
            length = tl.load(lengths_ptr + b)
            for j0 in range(0, num_cached, BLOCK_K):
                j = j0 + tl.arange(0, BLOCK_K)
                tl.store(index_ptr + b * num_cached + j, length + j, mask=j < num_cached)  # [B, 1, 1, P, 1]


def _launch(start_positions: Tensor, lengths: Tensor, inv_freq: Tensor, num_new: int, window: int,
            dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    outs = _empty_outputs(start_positions, inv_freq, num_new, window, dtype)
    batch = start_positions.shape[0]
    if batch == 0:
        return outs
    half = inv_freq.shape[0]
    _window_inputs_kernel[(num_new, batch)](start_positions.contiguous(), lengths.contiguous(),
                                            inv_freq.contiguous(), *outs, num_new, window, HALF=half,
                                            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_K=BLOCK_COLS, num_warps=4)
    return outs


@torch.library.custom_op("code2wav::window_inputs", mutates_args=())
def window_inputs(start_positions: Tensor, lengths: Tensor, inv_freq: Tensor, num_new: int, window: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(cos, signed_sin, mask, cache_index)``, see the module docstring."""
    check_shapes(start_positions, lengths, inv_freq, num_new, window)
    if start_positions.is_cuda and triton is not None:
        return _launch(start_positions, lengths, inv_freq, num_new, window, dtype)
    return reference(start_positions, lengths, inv_freq, num_new, window, dtype)


@window_inputs.register_fake
def _(start_positions: Tensor, lengths: Tensor, inv_freq: Tensor, num_new: int, window: int,
      dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_shapes(start_positions, lengths, inv_freq, num_new, window)
    return _empty_outputs(start_positions, inv_freq, num_new, window, dtype)


def run_interpreted(start_positions: Tensor, lengths: Tensor, inv_freq: Tensor, num_new: int, window: int,
                    dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The Triton kernel itself on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton
    was imported), for the CPU tests."""
    return _launch(start_positions, lengths, inv_freq, num_new, window, dtype)
