"""One sidecar of a pool: its connection (a ``SidecarClient`` whose streams are lost when it stops answering),
what the pool placed there, and whether it takes new streams (``placement.Candidate``).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

Thread-safety: the pool calls these under its own lock; ``SidecarClient`` is thread-safe on its own.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Callable

import torch

from .client import SidecarClient
from .errors import SidecarError
from .placement import Candidate
from .stream import Stream
from .wire_tensors import host_id

__all__ = ["PoolMember", "caller_gpu_uuid"]

log = logging.getLogger("code2wav.client")

RECONNECT_S = 1.0
"""Pause between attempts to connect a sidecar that did not answer."""


def caller_gpu_uuid(device: torch.device | int | None) -> str | None:
    """The caller's GPU (CUDA IPC goes to a sidecar on it): ``device``, else the current CUDA device when this
    process already uses CUDA; None on a CPU-only caller (never initialises CUDA itself)."""
    if device is None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return None
    from .cuda_ipc.channel import gpu_uuid
    return gpu_uuid(device)


class PoolMember:
    def __init__(self, address: str, connect: Callable[[str], SidecarClient]) -> None:
        self.address = address
        self._connect = connect
        self.client: SidecarClient | None = None
        self.named = True  # still among the pool's addresses (a DNS name may drop it: no new streams then)
        self.placed = 0  # streams this pool opened here, ever
        self.placed_at_report = 0  # ``placed`` when the ping of the latest load report left
        self.refused = False  # answered busy (or draining) since its latest load report
        self.last_chosen = 0
        self.last_error: str | None = None
        self.next_connect_s = 0.0
        self.streams: weakref.WeakSet[Stream] = weakref.WeakSet()  # this pool's streams here

    # ------------------------------------------------------------------ state

    @property
    def answering(self) -> bool:
        return self.client is not None and self.client.answering

    @property
    def open_here(self) -> int:
        """This pool's streams here that are neither closed nor lost."""
        return sum(1 for stream in list(self.streams) if not stream.closed and not stream.lost)

    def local_gpu(self, gpu_uuid: str | None) -> bool:
        """Whether this sidecar decodes on the caller's GPU (``gpu_uuid``) on this host, with CUDA IPC."""
        if gpu_uuid is None or self.client is None:
            return False
        caps = self.client.server_info.capabilities
        return bool(caps.get("cuda_ipc")) and caps.get("gpu_uuid") == gpu_uuid and caps.get("host_id") == host_id()

    def candidate(self, gpu_uuid: str | None) -> Candidate:
        load = self.client.load if self.client is not None else None
        return Candidate(self.address, self.named and self.answering and not self.refused, load,
                         self.placed - self.placed_at_report, self.local_gpu(gpu_uuid), self.last_chosen,
                         self.open_here if load is None else 0)

    # ------------------------------------------------------------------ the pool's monitor thread

    def try_connect(self, now_s: float) -> bool:
        """Connect if not connected and due (blocks up to the pool's connect timeout); True once connected."""
        if self.client is not None:
            return True
        if now_s < self.next_connect_s or not self.named:
            return False
        try:
            self.client = self._connect(self.address)
        except SidecarError as exc:
            self.next_connect_s = time.monotonic() + RECONNECT_S
            if self.last_error != str(exc):
                log.warning("pool: sidecar %s is not reachable: %s", self.address, exc)
            self.last_error = str(exc)
            return False
        self.last_error = None
        log.info("pool: sidecar %s joined (server %s)", self.address, self.client.server_info.server_id)
        return True

    def reported(self, placed_at_ping: int) -> None:
        """A load report arrived for a ping sent when ``placed`` was ``placed_at_ping``."""
        self.placed_at_report = max(self.placed_at_report, placed_at_ping)
        self.refused = False

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def status(self) -> dict:
        """What ``SidecarPool.members`` shows of it."""
        load = self.client.load if self.client is not None else None
        return {"address": self.address, "connected": self.client is not None, "answering": self.answering,
                "named": self.named, "placed": self.placed, "open_here": self.open_here,
                "load": load, "last_error": self.last_error}
