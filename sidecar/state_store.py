"""Slot-indexed arena for per-stream decoder state.

Every state entry a model declares (``state_layout()``: name -> per-row shape) is one preallocated tensor
``[num_slots + 1, *shape]`` on the model's device; the last slot is scratch, used by batch padding rows, so
a padding row can never write into a real stream's slot. A batched forward gathers rows by slot index and
the engine scatters the new state back only after the chunk succeeded (commit after success). Slot indices
are plain tensors, so a captured CUDA graph can do the same gather/scatter with them as static inputs.
The arena does not know any model: it only knows names and shapes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class ArenaFull(Exception):
    """No free slot: the caller maps this to a typed busy error."""


class StateArena:
    def __init__(self, layout: dict[str, tuple[int, ...]], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.device = device
        self.tensors: dict[str, Tensor] = {
            name: torch.zeros((num_slots + 1, *shape), dtype=dtype, device=device) for name, shape in layout.items()
        }
        self.positions = torch.zeros(num_slots + 1, dtype=torch.long, device=device)  # [S + 1] frames decoded
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out low slots first
        self._in_use = bytearray(num_slots)  # 1 where a slot is handed out: O(1) double-free check
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_stream = sum(math.prod(s) for s in layout.values()) * itemsize + 8

    @staticmethod
    def stream_nbytes(layout: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
        """Bytes one slot takes: its state entries plus its position."""
        return sum(math.prod(s) for s in layout.values()) * dtype.itemsize + 8

    @staticmethod
    def slots_for_budget(layout: dict[str, tuple[int, ...]], dtype: torch.dtype, budget_bytes: int,
                         max_slots: int = 65536) -> int:
        return max(1, min(max_slots, budget_bytes // StateArena.stream_nbytes(layout, dtype)))

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        """A zeroed slot (zero state at position 0 is "nothing decoded yet")."""
        if not self._free:
            raise ArenaFull(f"all {self.num_slots} stream slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = 1
        self.reset(slot)
        return slot

    def release(self, slot: int) -> None:
        """O(1): freeing N streams costs O(N) (no search of the free list)."""
        if not 0 <= slot < self.num_slots or not self._in_use[slot]:
            raise ValueError(f"slot {slot} is not allocated")
        self._in_use[slot] = 0
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        for t in self.tensors.values():
            t[slot].zero_()
        self.positions[slot] = 0

    def gather(self, slots: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """State rows for ``slots`` ``[B]`` (copies): ``({name: [B, ...]}, positions [B])``."""
        return {k: t.index_select(0, slots) for k, t in self.tensors.items()}, self.positions.index_select(0, slots)

    def scatter(self, slots: Tensor, state: dict[str, Tensor], positions: Tensor) -> None:
        """Commit new state rows. Padding rows must point at ``scratch_slot``."""
        for k, t in self.tensors.items():
            t.index_copy_(0, slots, state[k].to(t.dtype))
        self.positions.index_copy_(0, slots, positions)
