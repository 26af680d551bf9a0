"""The streaming contract every family's blocks share: the per-call context, the stateful-block base, the state
layout, and the container that threads ``(x, lengths)``.

A call hands the blocks a batch of rows, each with its own number of valid time steps (``lengths`` ``[B]``;
positions past it are right padding). A stateful block owns one named entry of the stream state: it reads it from
``ctx.state_in[state_key]`` (``[B, ...]``), runs over ``[state, new input]`` and writes the entry that ends at each
row's last *valid* step to ``ctx.state_out[state_key]``, so padding never reaches the state; a zero state is the
one-shot computation's left zero padding. All of it is tensor ops without data-dependent Python branches: a CUDA
graph captures it with the lengths as static inputs.

``assign_state_keys`` is the one walk that names every stateful block's entry and returns the state layout (what
a family's ``Contract.state`` is built from: ``family.state_specs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class StreamContext:
    """State in and out of one batched call (keys: the blocks' ``state_key``s), and per-row conditions a family's
    blocks read (``[B]`` tensors by name, e.g. a sample-rate bucket; the kit reads none)."""

    state_in: dict[str, Tensor]
    state_out: dict[str, Tensor] = field(default_factory=dict)
    conditions: dict[str, Tensor] = field(default_factory=dict)


class StatefulBlock(nn.Module):
    """A block that carries ``state_shape()`` per row between calls (None: nothing); ``state_key`` is set by
    ``assign_state_keys``."""

    state_key: str = ""

    def state_shape(self) -> tuple[int, ...] | None:
        return None


def assign_state_keys(root: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name every stateful block under ``root`` after its module path (``state_key``) and return the state layout:
    ``{state_key: per-row shape}`` in module order. Called once, when a family builds its module."""
    layout: dict[str, tuple[int, ...]] = {}
    for name, module in root.named_modules():
        if isinstance(module, StatefulBlock):
            shape = module.state_shape()
            if shape is not None:
                module.state_key = name
                layout[name] = tuple(shape)
    return layout


def zero_state(layout: dict[str, tuple[int, ...]], batch: int, dtype: torch.dtype,
               device: torch.device) -> dict[str, Tensor]:
    """A fresh stream's state for ``batch`` rows: ``{key: zeros [batch, *shape]}``."""
    return {key: torch.zeros((batch, *shape), dtype=dtype, device=device) for key, shape in layout.items()}


class StreamSequential(nn.ModuleList):
    """Runs its blocks in order, threading ``(x, lengths)`` through; children are named ``0``, ``1``, ..."""

    def forward(self, x: Tensor, lengths: Tensor,  # type: ignore[override]
                ctx: StreamContext) -> tuple[Tensor, Tensor]:
        for module in self:
            x, lengths = module(x, lengths, ctx)
        return x, lengths
