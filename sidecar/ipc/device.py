"""Opening a client's region on the sidecar's GPU (engine thread only): memory handle -> byte tensor, events, and
for a ``read`` region the doorbells its armed chunks name (``doorbells``: shared host memory, named to the client).

Mechanism only; ``regions`` decides when to open and close. An opened region is checked three ways before
use: it must live on this sidecar's device (a handle from another GPU may still map through peer access),
its real allocation must be at least the size the client claimed, and its events must open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from code2wav.proto import RegisterRegion

from .cudart import Cudart, CudaIpcError, load_cudart
from .doorbells import DeviceBytes, Doorbells

__all__ = ["CudaIpcDevice", "OpenedRegion", "CudaIpcError", "gpu_uuid"]

log = logging.getLogger(__name__)

NUM_SERVER_EVENTS = 16
"""Events per write region, recorded round-robin: one is re-recorded only 16 steps later."""


def gpu_uuid(device: torch.device) -> str:
    """``GPU-xxxxxxxx-...``, the form ``nvidia-smi -L`` prints."""
    text = str(torch.cuda.get_device_properties(device).uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


@dataclass(eq=False)
class OpenedRegion:
    pointer: int
    nbytes: int
    data: torch.Tensor  # uint8 [nbytes], aliasing the client's memory
    events: list = field(default_factory=list)  # torch.cuda.Event, interprocess
    event_handles: tuple[str, ...] = ()  # for write regions: what the client opens
    doorbells: Doorbells | None = None  # for read regions: the armed chunks' words (shared host memory)


class CudaIpcDevice:
    def __init__(self, device: torch.device, cudart: Cudart | None = None) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.uuid = gpu_uuid(device)
        self.cudart = cudart or load_cudart()

    def open(self, msg: RegisterRegion) -> OpenedRegion:
        """Map the region and its events; raises ``CudaIpcError`` saying what is wrong."""
        pointer = self.cudart.open_mem_handle(bytes.fromhex(msg.ipc_handle), self.index)
        try:
            owner = self.cudart.pointer_device(pointer)
            if owner != self.index:
                raise CudaIpcError(f"the memory is on device {owner}, this sidecar decodes on device {self.index}")
            actual = self.cudart.allocation_nbytes(pointer)
            if actual < msg.nbytes:
                raise CudaIpcError(f"the region claims {msg.nbytes} bytes but the allocation holds {actual}")
            data = torch.as_tensor(DeviceBytes(pointer, msg.nbytes), device=self.device)  # [nbytes] uint8
            doorbells = None
            if msg.access == "read":
                events = [torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(h)) for h in msg.events]
                handles: tuple[str, ...] = ()
                doorbells = self._doorbells(len(msg.events))
            else:
                events = [torch.cuda.Event(interprocess=True) for _ in range(NUM_SERVER_EVENTS)]
                handles = tuple(ev.ipc_handle().hex() for ev in events)
        except CudaIpcError:
            self.cudart.close_mem_handle(pointer)
            raise
        except RuntimeError as exc:  # torch's event IPC errors
            self.cudart.close_mem_handle(pointer)
            raise CudaIpcError(f"opening the region's events failed: {exc}") from None
        return OpenedRegion(pointer, msg.nbytes, data, events, handles, doorbells)

    def _doorbells(self, num_words: int) -> Doorbells | None:
        """A read region's doorbells, or None (its chunks then go by their codes events) where they cannot be made:
        no writable ``/dev/shm``, or host memory that cannot be registered for the GPU (logged)."""
        try:
            return Doorbells(self.cudart, self.device, num_words)
        except (OSError, CudaIpcError, RuntimeError) as exc:
            log.warning("no doorbells for this region (%s: %s): its CUDA IPC chunks go by their codes events",
                        type(exc).__name__, exc)
            return None

    def close(self, region: OpenedRegion) -> None:
        """Unmap, once the work queued on the engine stream (which may still write into it: replies do not wait
        for the audio) is done; the caller guarantees no chunk that uses it is still to be decoded."""
        torch.cuda.current_stream(self.device).synchronize()
        region.data = None  # type: ignore[assignment]
        region.events = []
        if region.doorbells is not None:
            region.doorbells.close()
            region.doorbells = None
        self.cudart.close_mem_handle(region.pointer)
