"""Streaming plumbing shared by the decoder's blocks: the per-call context (the state-tail gather is
``kernels/snake.py``'s ``cat_with_tail``).

Every stateful block owns one named entry of the stream state. A call hands the blocks a batch of rows,
each with its own number of valid time steps (``lengths``; positions past it are right padding). A block
reads its entry from ``ctx.state_in`` (``[B, ...]``), runs over ``[state, new input]`` and writes the
tail that ends at each row's last *valid* step to ``ctx.state_out``, so padding never reaches the state.
All of it is tensor ops without data-dependent Python branches: a CUDA graph can capture it with the
lengths as static inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class StreamCtx:
    """State in and out of one batched call. Keys are the blocks' ``state_key``s."""

    state_in: dict[str, Tensor]
    state_out: dict[str, Tensor] = field(default_factory=dict)


class StatefulBlock(torch.nn.Module):
    """A block that carries ``state_shape()`` per row between calls; ``state_key`` is set by its owner."""

    state_key: str = ""

    def state_shape(self) -> tuple[int, ...] | None:
        return None
