"""How many stream slots the state arena gets (policy; a pure function, tested on CPU).

Sources, first that applies wins:
1. ``streams.max_streams`` (or ``--max-streams``): that many slots.
2. ``streams.state_memory_bytes``: as many slots as that budget holds.
3. On a GPU, from the device memory free after the weights are loaded: minus what the CUDA graphs may take
   (``graphs.max_graph_memory_bytes``; ``UNCAPPED_GRAPH_RESERVE_BYTES`` when it is null and graphs are on)
   minus ``streams.state_memory_margin_bytes`` (left for eager steps, cuDNN workspace, the CUDA IPC regions
   and whatever else shares the GPU), at most ``streams.auto_max_streams`` slots.
4. On the CPU (no device memory to measure): ``CPU_STATE_MEMORY_BYTES``.
Every source is capped at ``MAX_SLOTS``.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_STATE_MEMORY_BYTES = 256 << 20  # a laptop's idle CPU server stays well under 1.5 GB RSS
UNCAPPED_GRAPH_RESERVE_BYTES = 16 << 30
MAX_SLOTS = 65536


class ArenaSizingError(ValueError):
    """The device has no room for a single stream under the configured reserve and margin."""


@dataclass(frozen=True)
class ArenaPlan:
    num_slots: int
    budget_bytes: int
    source: str  # max_streams | state_memory_bytes | free_device_memory | cpu_default

    def describe(self, bytes_per_stream: int) -> str:
        return (f"{self.num_slots} slots x {bytes_per_stream / 1e6:.2f} MB = "
                f"{self.num_slots * bytes_per_stream / 2**30:.2f} GiB (from {self.source}, budget "
                f"{self.budget_bytes / 2**30:.2f} GiB)")


def plan_arena(bytes_per_stream: int, *, max_streams: int | None, state_memory_bytes: int | None,
               free_device_bytes: int | None, graph_reserve_bytes: int, margin_bytes: int,
               auto_max_streams: int) -> ArenaPlan:
    """Slots for an arena whose streams take ``bytes_per_stream`` each (see the module docstring).
    ``free_device_bytes`` None: no device memory to measure (CPU)."""
    if bytes_per_stream < 1:
        raise ValueError(f"bytes_per_stream must be >= 1, got {bytes_per_stream}")
    if max_streams is not None:
        return ArenaPlan(min(MAX_SLOTS, max_streams), max_streams * bytes_per_stream, "max_streams")
    if state_memory_bytes is not None:
        return ArenaPlan(_slots(state_memory_bytes, bytes_per_stream, MAX_SLOTS), state_memory_bytes,
                         "state_memory_bytes")
    if free_device_bytes is None:
        return ArenaPlan(_slots(CPU_STATE_MEMORY_BYTES, bytes_per_stream, MAX_SLOTS), CPU_STATE_MEMORY_BYTES,
                         "cpu_default")
    budget = free_device_bytes - graph_reserve_bytes - margin_bytes
    if budget < bytes_per_stream:
        raise ArenaSizingError(
            f"no device memory left for stream state: {free_device_bytes / 2**30:.2f} GiB free after the weights, "
            f"{graph_reserve_bytes / 2**30:.2f} GiB reserved for CUDA graphs (graphs.max_graph_memory_bytes) and "
            f"{margin_bytes / 2**30:.2f} GiB margin (streams.state_memory_margin_bytes); lower those, or set "
            f"streams.state_memory_bytes or --max-streams explicitly")
    return ArenaPlan(_slots(budget, bytes_per_stream, min(MAX_SLOTS, auto_max_streams)), budget,
                     "free_device_memory")


def _slots(budget_bytes: int, bytes_per_stream: int, cap: int) -> int:
    return max(1, min(cap, budget_bytes // bytes_per_stream))
