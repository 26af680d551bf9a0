"""Chunk plans for streaming tests: what a property test draws, clipped to a stream's length."""

from __future__ import annotations

from hypothesis import strategies as st


def clip_sizes(sizes: list[int], total: int) -> list[int]:
    """``sizes`` cut to sum to exactly ``total`` (the last one shortened, or one more chunk for the rest)."""
    out, left = [], total
    for s in sizes:
        if left == 0:
            break
        out.append(min(s, left))
        left -= out[-1]
    if left:
        out.append(left)
    return out


def splits_of(total: int):
    """Chunk-size lists summing to ``total``."""
    return st.lists(st.integers(1, total), min_size=1, max_size=total).map(lambda xs: clip_sizes(xs, total))
