"""Synthetic codec traffic shaped like vLLM-Omni's Code2Wav connector: first chunk of
``first_chunk_frames`` (1 in the default Qwen3-TTS deploy file), then chunks of ``chunk_frames`` (25)."""

from __future__ import annotations

import torch


def chunk_sizes(num_frames: int, first_chunk_frames: int = 1, chunk_frames: int = 25) -> list[int]:
    """The chunk sizes of a ``num_frames`` stream; ``chunk_frames`` must be >= 1 (0 would never end)."""
    if chunk_frames < 1 or first_chunk_frames < 0:
        raise ValueError(f"chunk_frames must be >= 1 and first_chunk_frames >= 0, got {chunk_frames} and "
                         f"{first_chunk_frames}")
    sizes: list[int] = []
    left = num_frames
    if left > 0 and first_chunk_frames > 0:
        sizes.append(min(first_chunk_frames, left))
        left -= sizes[-1]
    while left > 0:
        sizes.append(min(chunk_frames, left))
        left -= sizes[-1]
    return sizes


def synthetic_codes(num_quantizers: int, num_frames: int, codebook_size: int, seed: int) -> torch.Tensor:
    """Seeded random codes ``[Q, T]`` int64."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, codebook_size, (num_quantizers, num_frames), generator=gen)
