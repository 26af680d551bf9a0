"""What a connection hands out per message, in pure Python (no device work): byte ranges of a region
(``SlotAllocator``) and codes events (``EventPool``).

Ranges are first-fit, aligned to ``align`` bytes (256: what CUDA gives ``cudaMalloc`` blocks, enough for every
dtype). Chunks are allocated and freed roughly in order, so the free list stays short.

An event is handed out again only once no unanswered chunk names it: recording it again replaces what a query
or a wait sees, so if an older chunk still named it, the sidecar could read that chunk's codes as soon as a
later copy on another stream finished, before the chunk's own copy did.
"""

from __future__ import annotations

import bisect

__all__ = ["EventPool", "SlotAllocator", "next_token"]


class SlotAllocator:
    def __init__(self, nbytes: int, align: int = 256) -> None:
        if nbytes <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(f"need nbytes > 0 and a power-of-two align, got {nbytes}, {align}")
        self.nbytes = nbytes
        self.align = align
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size), coalesced
        self._used: dict[int, int] = {}  # offset -> size

    @property
    def used_nbytes(self) -> int:
        return sum(self._used.values())

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of at least ``nbytes`` (rounded up to ``align``), or None when full."""
        size = max(self.align, -(-nbytes // self.align) * self.align)
        for index, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, free_size - size)
                self._used[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)  # KeyError: a double free is a bug
        index = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(index, (offset, size))
        if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:  # merge right
            self._free[index] = (offset, size + self._free.pop(index + 1)[1])
        if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:  # merge left
            left_offset, left_size = self._free[index - 1]
            self._free[index - 1] = (left_offset, left_size + self._free.pop(index)[1])


class EventPool:
    """Round-robin over ``num_events`` events, skipping those still named by unanswered chunks."""

    def __init__(self, num_events: int) -> None:
        self.uses = [0] * num_events  # unanswered chunks naming each event
        self._next = 0

    def alloc(self, num_chunks: int) -> int | None:
        """An event for a message of ``num_chunks`` chunks, or None when every event is still named."""
        num_events = len(self.uses)
        for step in range(num_events):
            index = (self._next + step) % num_events
            if self.uses[index] == 0:
                self._next = (index + 1) % num_events
                self.uses[index] = num_chunks
                return index
        return None

    def free(self, index: int) -> None:
        """One chunk naming ``index`` got its answer."""
        if self.uses[index] <= 0:
            raise ValueError(f"event {index} is not in use")  # a double free is a bug
        self.uses[index] -= 1


def next_token(last: int) -> int:
    """The doorbell token after ``last`` (0: none yet): even, growing by 2, cyclic over 32 bits (2^32 - 2 is followed
    by 2, never 0: the words start at 0). The sidecar releases a word with the odd token + 1, which the next token
    passes (its wait is a cyclic ``>=``)."""
    return (last + 2) & 0xFFFFFFFF or 2
