"""Slot-indexed arena for per-stream decoder state.

Every state entry a model declares (``state_layout()``: name -> per-row shape) is a view ``[num_slots + 1, *shape]``
of one preallocated tensor ``[num_slots + 1, total]`` on the model's device (a slot's entries side by side), so a
batch's state is gathered with one ``index_select`` and committed with one ``cat`` and one ``index_copy_``, not
two kernels per entry (about 30 entries: at batch 1 the step is bound by kernel launches). The last slot is
scratch, used by batch padding rows, so a padding row can never write into a real stream's slot. A batched
forward gathers rows by slot index and the engine scatters the new state back only after the chunk succeeded
(commit after success). Slot indices are plain tensors, so a captured CUDA graph can do the same gather/scatter
with them as static inputs.
The arena does not know any model: it only knows names and shapes.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import Tensor


POSITION_NBYTES = 8
"""Each slot's position (frames decoded so far), an int64 beside its state."""


def slot_nbytes(layout: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes one stream slot takes: every state entry of ``layout`` (per-row shapes) in ``dtype``, and its position.
    The one definition: the arena, its sizing and the metrics all use it."""
    return sum(math.prod(shape) for shape in layout.values()) * dtype.itemsize + POSITION_NBYTES


VECTOR_NBYTES = 32
"""Twice the widest access torch's vectorised elementwise kernels make (16 bytes in torch 2.11-2.13, whose form they
pick by the output's alignment): a margin should a later torch widen it."""


def warm_slots(row_nbytes: int, num_rows: int) -> int:
    """How many rows, from the first, take every alignment a row of ``row_nbytes`` can have (modulo
    ``VECTOR_NBYTES``), of ``num_rows``: resetting them when the arena is made runs each vectorised kernel form a
    later reset needs. On a GPU each form is loaded on its first launch (CUDA's lazy loading), and loading waits for
    the device; a stream opened while a step is parked on a doorbell would wait for its release."""
    return min(num_rows, VECTOR_NBYTES // math.gcd(VECTOR_NBYTES, row_nbytes))


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
        self.shapes = dict(layout)
        sizes = [math.prod(shape) for shape in layout.values()]
        self.flat = torch.zeros((num_slots + 1, sum(sizes)), dtype=dtype, device=device)  # [S + 1, total]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._columns = [(name, off, off + size, shape)
                         for (name, shape), off, size in zip(self.shapes.items(), offsets, sizes)]
        self.tensors: dict[str, Tensor] = self._split(self.flat)  # name -> [S + 1, *shape] (views of flat)
        self.positions = torch.zeros(num_slots + 1, dtype=torch.long, device=device)  # [S + 1] frames decoded
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out low slots first
        self._in_use = bytearray(num_slots)  # 1 where a slot is handed out: O(1) double-free check
        self.bytes_per_stream = slot_nbytes(layout, dtype)
        row_nbytes = math.gcd(self.flat.shape[1] * dtype.itemsize, POSITION_NBYTES)  # both tensors' row strides
        for slot in range(warm_slots(row_nbytes, num_slots + 1)):
            self.reset(slot)  # every alignment's kernels loaded now, not while a stream opens during a step

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, position: int = 0) -> int:
        """A zeroed slot at ``position`` (zero state at position 0 is "nothing decoded yet"; a failover replay starts
        at its original position)."""
        if not self._free:
            raise ArenaFull(f"all {self.num_slots} stream slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = 1
        self.reset(slot, position)
        return slot

    def release(self, slot: int) -> None:
        """O(1): freeing N streams costs O(N) (no search of the free list)."""
        if not 0 <= slot < self.num_slots or not self._in_use[slot]:
            raise ValueError(f"slot {slot} is not allocated")
        self._in_use[slot] = 0
        self._free.append(slot)

    def _split(self, rows: Tensor) -> dict[str, Tensor]:
        """Each entry's view ``[N, *shape]`` of ``rows`` ``[N, total]``."""
        return {name: rows[:, start:end].view(rows.shape[0], *shape) for name, start, end, shape in self._columns}

    def reset(self, slot: int, position: int = 0) -> None:
        """Zero ``slot``'s state and set its position (frames decoded so far). Kernels with the values as arguments,
        queued on the current stream: no copy from the host, which would wait for the device (a step in flight, or
        one parked on a doorbell: ``ipc/watchdog.py``)."""
        self.flat[slot].zero_()
        self.positions[slot].fill_(position)

    def gather(self, slots: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """State rows for ``slots`` ``[B]`` (one copy, split into views): ``({name: [B, ...]}, positions [B])``."""
        rows = self.flat.index_select(0, slots)  # [B, total]
        return self._split(rows), self.positions.index_select(0, slots)

    def scatter(self, slots: Tensor, state: dict[str, Tensor], positions: Tensor,
                keep: Tensor | None = None) -> Tensor:
        """Commit new state rows, except a row whose new state is not finite in the arena's dtype, or whose
        ``keep`` ``[B]`` (bool) is False: that row is written to ``scratch_slot`` instead, as a padding row is, so its
        stream's slot keeps its state and position (a poisoned chunk never reaches its stream). Returns which rows
        were committed, ``[B]`` bool on the device. Graph-capturable (no host reads). Padding rows must point at
        ``scratch_slot``."""
        batch = slots.shape[0]
        for name, shape in self.shapes.items():  # (host-side: the flat copy would shift a wrong shape silently)
            if tuple(state[name].shape) != (batch, *shape):
                raise ValueError(f"state entry {name!r}: expected shape {(batch, *shape)}, got "
                                 f"{tuple(state[name].shape)}")
        committed = torch.ones(batch, dtype=torch.bool, device=slots.device) if keep is None else keep  # [B]
        rows = None
        if self.shapes:
            rows = torch.cat([state[name].reshape(batch, -1).to(self.flat.dtype) for name in self.shapes],
                             dim=1)  # [B, total]
            committed = committed & torch.isfinite(rows).all(dim=1)  # [B]
        targets = torch.where(committed, slots, self.scratch_slot)  # [B]: a refused row lands in the scratch slot
        if rows is not None:
            self.flat.index_copy_(0, targets, rows)
        self.positions.index_copy_(0, targets, positions)
        return committed
