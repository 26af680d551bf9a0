"""Region bookkeeping on the loop thread (sans-IO): register, look up, bounds-check, count uses, close.

Rules:
- A region belongs to the connection that registered it; another connection naming its id gets not_found.
- Every ``(region, offset, nbytes)`` is checked against the region's size and the dtype's alignment before
  any device work is queued (``check_span``, a pure function).
- Each queued chunk holds a use on the regions it reads or writes; unregistering (or the client's ``bye``,
  re-handshake or TTL expiry) marks the region closing, and it is closed once its last use is done.
- Opening and closing run on the engine thread (``DeviceOp``s the server drains); nothing else here touches
  the device.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from code2wav import proto
from code2wav.proto import CudaIpcLoc, ErrorCode

from ..work import ChunkRejected
from .device import CudaIpcDevice, CudaIpcError, OpenedRegion

log = logging.getLogger(__name__)

__all__ = ["check_span", "Region", "DeviceOp", "RegionService", "TORCH_DTYPES"]

TORCH_DTYPES = {d.name: getattr(torch, d.name) for d in proto.WIRE_DTYPES}  # a wire dtype's name is torch's


def check_span(region_nbytes: int, offset: int, nbytes: int, itemsize: int) -> str | None:
    """Why ``[offset, offset + nbytes)`` may not be used in a region of ``region_nbytes``; None if it may."""
    if offset % itemsize:
        return f"offset {offset} is not a multiple of the dtype's {itemsize}-byte alignment"
    if offset + nbytes > region_nbytes:
        return f"bytes [{offset}, {offset + nbytes}) fall outside the region's {region_nbytes} bytes"
    return None


@dataclass(eq=False)
class Region:
    region_id: int
    client: bytes
    access: str
    nbytes: int
    opened: OpenedRegion
    uses: int = 0
    closing: bool = False
    close_waiters: list = field(default_factory=list)  # request ids of unregister_region messages
    next_event: int = 0


@dataclass(eq=False)
class DeviceOp:
    """Work for the engine thread: open a registration, or close a region."""

    kind: str  # "open" | "close"
    identity: bytes
    message: Any = None  # proto.RegisterRegion for "open"
    session: Any = None  # for "open": the client session that asked (its regions die with it)
    region: Region | None = None
    result: Any = None
    error: str | None = None


class RegionService:
    def __init__(self, device: CudaIpcDevice | None, host_id: str | None, metrics,
                 send: Callable[[bytes, Any], None], error: Callable[[bytes, int, ErrorCode, str], None],
                 unavailable_reason: str, session_of: Callable[[bytes], Any]) -> None:
        """``session_of(identity)``: the connection's current session (any object, None when it has none); a
        region whose opening finishes after its session ended is closed at once instead of registered."""
        self.device = device
        self.host_id = host_id
        self.metrics = metrics
        self._send = send
        self._error = error
        self.unavailable_reason = unavailable_reason
        self.session_of = session_of
        self.regions: dict[int, Region] = {}
        self.device_ops: list[DeviceOp] = []
        self._ids = itertools.count(1)

    def capabilities(self) -> dict[str, Any]:
        if self.device is None:
            return {"cuda_ipc": False}
        return {"cuda_ipc": True, "gpu_uuid": self.device.uuid, "host_id": self.host_id}

    # ------------------------------------------------------------------ messages (loop thread)
    def on_register(self, identity: bytes, msg: proto.RegisterRegion) -> None:
        rid = msg.request_id
        if self.device is None:
            return self._refuse(identity, rid, "unsupported",
                                f"this sidecar has no CUDA IPC ({self.unavailable_reason}); send inline tensors")
        if msg.gpu_uuid != self.device.uuid:
            return self._refuse(identity, rid, "different_gpu",
                                f"the region is on {msg.gpu_uuid}, this sidecar decodes on {self.device.uuid}; "
                                "CUDA IPC needs the same GPU: send inline tensors")
        self.device_ops.append(DeviceOp("open", identity, message=msg, session=self.session_of(identity)))

    def on_unregister(self, identity: bytes, msg: proto.UnregisterRegion) -> None:
        region = self.regions.get(msg.region_id)
        if region is None or region.client != identity:
            return self._error(identity, msg.request_id, ErrorCode.NOT_FOUND,
                               f"region {msg.region_id} is not registered on this connection")
        region.close_waiters.append(msg.request_id)
        self._close_when_idle(region)

    def drop_client(self, identity: bytes) -> None:
        for region in [r for r in self.regions.values() if r.client == identity]:
            self._close_when_idle(region)

    # ------------------------------------------------------------------ chunks (loop thread)
    def lookup(self, identity: bytes, loc: CudaIpcLoc, access: str, what: str) -> Region:
        region = self.regions.get(loc.region_id)
        if region is None or region.client != identity or region.closing:
            raise ChunkRejected(ErrorCode.NOT_FOUND, f"{what}: region {loc.region_id} is not registered "
                                "on this connection (register_region first)")
        if region.access != access:
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT,
                                f"{what}: region {loc.region_id} was registered for {region.access}, not {access}")
        return region

    def view(self, region: Region, desc: proto.TensorDesc, what: str) -> torch.Tensor:
        """The descriptor's bytes as a tensor aliasing the region (metadata only: no device work)."""
        loc = desc.loc
        assert isinstance(loc, CudaIpcLoc)
        reason = check_span(region.nbytes, loc.offset, loc.nbytes, desc.itemsize)
        if reason is not None:
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"{what}: {reason} (region {region.region_id})")
        raw = region.opened.data[loc.offset: loc.offset + loc.nbytes]  # [nbytes] uint8
        return raw.view(TORCH_DTYPES[desc.dtype]).view(desc.shape)

    def acquire(self, region: Region) -> None:
        region.uses += 1

    def release(self, region: Region) -> None:
        region.uses -= 1
        if region.closing:
            self._close_when_idle(region)

    # ------------------------------------------------------------------ device ops
    def next_device_op(self) -> DeviceOp | None:
        """The oldest region open/close still to do on the engine thread (removed from the queue), or None."""
        return self.device_ops.pop(0) if self.device_ops else None

    def run_op(self, op: DeviceOp) -> None:
        """Engine thread: do the device part of ``op``; errors land in ``op.error``."""
        assert self.device is not None
        try:
            if op.kind == "open":
                op.result = self.device.open(op.message)
            else:
                self.device.close(op.region.opened)
        except CudaIpcError as exc:
            op.error = str(exc)

    def op_done(self, op: DeviceOp) -> None:
        """Loop thread: answer the client once the device part of ``op`` is done."""
        if op.kind == "close":
            self.metrics.ipc_regions.labels(access=op.region.access).dec()
            for request_id in op.region.close_waiters:
                self._send(op.identity, proto.RegionUnregistered(request_id, op.region.region_id))
            return
        msg: proto.RegisterRegion = op.message
        if op.error is not None:
            log.warning("client region not opened: %s", op.error)
            return self._refuse(op.identity, msg.request_id, "open_failed",
                                f"cannot open the CUDA IPC region: {op.error}; send inline tensors")
        region = Region(next(self._ids), op.identity, msg.access, msg.nbytes, op.result)
        self.metrics.ipc_regions.labels(access=msg.access).inc()
        current = self.session_of(op.identity)
        if current is None or current is not op.session:  # bye, re-handshake or TTL while it was opening
            self.device_ops.append(DeviceOp("close", region.client, region=region))
            return
        self.regions[region.region_id] = region
        doorbells = op.result.doorbells
        self._send(op.identity, proto.RegionRegistered(msg.request_id, region.region_id, op.result.event_handles,
                                                       None if doorbells is None else doorbells.name))

    def _close_when_idle(self, region: Region) -> None:
        region.closing = True
        if region.uses == 0 and self.regions.pop(region.region_id, None) is not None:
            self.device_ops.append(DeviceOp("close", region.client, region=region))

    def _refuse(self, identity: bytes, request_id: int, reason: str, message: str) -> None:
        self.metrics.ipc_register_failures.labels(reason=reason).inc()
        self._error(identity, request_id, ErrorCode.INVALID_ARGUMENT, message)
