"""CUDA IPC regions: the messages that register and unregister them, and their parsers.

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing
outside ``proto``. Handles travel as lowercase hex strings (headers carry no
``bin`` values): a CUDA IPC memory or event handle is 64 bytes, 128 hex digits.

A region is a block of GPU memory the client allocated and exported once. The
server opens it once, checks every ``(region, offset, nbytes)`` against its size,
and closes it when the client unregisters it (deferred while chunks use it),
says ``bye``, re-handshakes or is forgotten after the server's TTL.

- ``access="read"``: the server reads codes from it. The client also exports
  interprocess events (``events``); each chunk whose codes live there names the
  event (``codes_event``) it recorded after writing them. The server decodes
  the chunk once that event is complete (it queries it; it never waits on a
  client's unfinished work on the device); a chunk whose event stays incomplete
  fails with ``deadline_exceeded`` after the server's ``codes_event_timeout_s``.
- ``access="write"``: the server writes audio into it. The server creates the
  events and returns their handles in ``region_registered``; each result whose
  audio went there names the event (``audio_event``) the server recorded after
  writing. The result may arrive before that event completes (the server does
  not wait for it): clients wait on it (stream- or host-side) before reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from ._check import (
    INT64_MAX,
    UINT64_MAX,
    as_map,
    check_str,
    get_choice,
    get_int,
    get_list,
    get_str,
    invalid,
    reject_unknown_keys,
)
from ._flat import FlatMessage
from .limits import Limits

__all__ = [
    "IPC_HANDLE_NBYTES",
    "MAX_REGION_EVENTS",
    "MAX_REGION_NBYTES",
    "REGION_ACCESS",
    "RegisterRegion",
    "RegionRegistered",
    "UnregisterRegion",
    "RegionUnregistered",
    "parse_register_region",
    "parse_unregister_region",
    "parse_region_registered",
    "parse_region_unregistered",
]

IPC_HANDLE_NBYTES = 64
"""``cudaIpcMemHandle_t`` and ``cudaIpcEventHandle_t`` are both 64 opaque bytes."""
MAX_REGION_EVENTS = 64
MAX_REGION_NBYTES = 1 << 40
REGION_ACCESS: tuple[str, ...] = ("read", "write")
_HEX = frozenset("0123456789abcdef")
_REGISTER_KEYS = frozenset({"type", "request_id", "gpu_uuid", "ipc_handle", "nbytes", "access", "events"})
_UNREGISTER_KEYS = frozenset({"type", "request_id", "region_id"})


def check_handle(value: object, name: str) -> str:
    """A 64-byte handle as 128 lowercase hex digits."""
    text = check_str(value, name, max_nbytes=2 * IPC_HANDLE_NBYTES)
    if len(text) != 2 * IPC_HANDLE_NBYTES or not set(text) <= _HEX:
        invalid(f"{name} must be {2 * IPC_HANDLE_NBYTES} lowercase hex digits (a {IPC_HANDLE_NBYTES}-byte handle)")
    return text


def _handles(obj: dict[str, Any], key: str, what: str, *, lo: int, hi: int) -> tuple[str, ...]:
    values = get_list(obj, key, what, max_len=MAX_REGION_EVENTS)
    if not lo <= len(values) <= hi:
        invalid(f"{what}.{key} must hold {lo}..{hi} event handles, got {len(values)}")
    return tuple(check_handle(v, f"{what}.{key}[{i}]") for i, v in enumerate(values))


@dataclass(frozen=True)
class RegisterRegion:
    """Client -> server: export one device memory block; answered by ``region_registered``."""

    TYPE: ClassVar[str] = "register_region"
    request_id: int
    gpu_uuid: str
    ipc_handle: str
    nbytes: int
    access: str
    events: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "request_id": self.request_id,
            "gpu_uuid": self.gpu_uuid,
            "ipc_handle": self.ipc_handle,
            "nbytes": self.nbytes,
            "access": self.access,
            "events": list(self.events),
        }


@dataclass(frozen=True)
class UnregisterRegion(FlatMessage):
    """Client -> server: close a region; answered by ``region_unregistered`` once no chunk uses it."""

    TYPE: ClassVar[str] = "unregister_region"
    request_id: int
    region_id: int


@dataclass(frozen=True)
class RegionRegistered:
    """Server -> client: the region's id; for ``write`` regions the server's event handles."""

    TYPE: ClassVar[str] = "region_registered"
    request_id: int
    region_id: int
    events: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id, "region_id": self.region_id,
                "events": list(self.events)}


@dataclass(frozen=True)
class RegionUnregistered(FlatMessage):
    TYPE: ClassVar[str] = "region_unregistered"
    request_id: int
    region_id: int


def parse_register_region(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> RegisterRegion:
    what = "register_region"
    reject_unknown_keys(header, _REGISTER_KEYS, what)
    access = get_choice(header, "access", what, choices=REGION_ACCESS)
    events = _handles(header, "events", what, lo=1, hi=MAX_REGION_EVENTS) if access == "read" else ()
    if access == "write" and header.get("events"):
        invalid("register_region.events must be empty for a write region (the server creates its events)")
    return RegisterRegion(
        request_id=get_int(header, "request_id", what, lo=0, hi=UINT64_MAX),
        gpu_uuid=get_str(header, "gpu_uuid", what, max_nbytes=limits.max_id_len),
        ipc_handle=check_handle(header.get("ipc_handle"), f"{what}.ipc_handle"),
        nbytes=get_int(header, "nbytes", what, lo=1, hi=MAX_REGION_NBYTES),
        access=access,
        events=events,
    )


def parse_unregister_region(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> UnregisterRegion:
    reject_unknown_keys(header, _UNREGISTER_KEYS, "unregister_region")
    return UnregisterRegion(
        request_id=get_int(header, "request_id", "unregister_region", lo=0, hi=UINT64_MAX),
        region_id=get_int(header, "region_id", "unregister_region", lo=0, hi=INT64_MAX),
    )


def parse_region_registered(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> RegionRegistered:
    what = "region_registered"
    events = _handles(header, "events", what, lo=0, hi=MAX_REGION_EVENTS) if "events" in header else ()
    return RegionRegistered(
        request_id=get_int(header, "request_id", what, lo=0, hi=UINT64_MAX),
        region_id=get_int(header, "region_id", what, lo=0, hi=INT64_MAX),
        events=events,
    )


def parse_region_unregistered(header: dict[str, Any], limits: Limits,
                              frames: Sequence[Any]) -> RegionUnregistered:
    what = "region_unregistered"
    as_map(header, what)
    return RegionUnregistered(
        request_id=get_int(header, "request_id", what, lo=0, hi=UINT64_MAX),
        region_id=get_int(header, "region_id", what, lo=0, hi=INT64_MAX),
    )
