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

Device-armed hand-off: a server that arms steps returns ``doorbells`` with a ``read`` region: the name of a file of
shared host memory in ``/dev/shm``, which both processes map and register for the GPU, one 32-bit word per
registered event. A chunk with ``codes_token`` T (even) names word ``codes_event``: on one GPU
stream the client writes its codes, then T into that word (``cuStreamWriteValue32``), then records the event. The
server queues the step behind a GPU wait for the word to reach T (cyclic ``>=``), without looking at the event, and
snapshots the word before it reads the codes: a row whose word was not T there is refused, not decoded. A word
still behind T ``armed_wait_s`` after the wait was queued is raised to T + 1 by the server (ending the wait; the chunk
fails with ``deadline_exceeded``), and the region's later chunks go unarmed. A word serves one unanswered message at
a time, with tokens that grow (cyclic); proto/README.md, section 3, has the rules.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._check import check_str, invalid
from .constants import MAX_REGION_EVENTS
from .declare import message, rule, wire
from .wire_containers import ArrayOf, Nullable
from .wire_types import UINT64, Choice, Int, Str, WireType, field_name

__all__ = [
    "IPC_HANDLE_NBYTES",
    "MAX_REGION_EVENTS",
    "MAX_REGION_NBYTES",
    "REGION_ACCESS",
    "Handle",
    "DoorbellsName",
    "DOORBELLS_PREFIX",
    "is_doorbells_name",
    "RegisterRegion",
    "RegionRegistered",
    "UnregisterRegion",
    "RegionUnregistered",
]

IPC_HANDLE_NBYTES = 64
"""``cudaIpcMemHandle_t`` and ``cudaIpcEventHandle_t`` are both 64 opaque bytes."""
MAX_REGION_NBYTES = 1 << 40
REGION_ACCESS: tuple[str, ...] = ("read", "write")
_HEX = frozenset("0123456789abcdef")


def check_handle(value: object, name: str) -> str:
    """A 64-byte handle as 128 lowercase hex digits."""
    text = check_str(value, name, max_nbytes=2 * IPC_HANDLE_NBYTES)
    if len(text) != 2 * IPC_HANDLE_NBYTES or not set(text) <= _HEX:
        invalid(f"{name} must be {2 * IPC_HANDLE_NBYTES} lowercase hex digits (a {IPC_HANDLE_NBYTES}-byte handle)")
    return text


class Handle(WireType):
    """A CUDA IPC memory or event handle: 64 bytes as 128 lowercase hex digits."""

    type_doc, plural_doc = "str", "str"
    limits_doc = f"{2 * IPC_HANDLE_NBYTES} lowercase hex digits"

    def __init__(self) -> None:
        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> str:
            return check_handle(value, field_name(path, key))
        self.parse = parse


DOORBELLS_PREFIX = "code2wav-doorbells-"
_DIGITS = frozenset("0123456789")


def is_doorbells_name(text: str) -> bool:
    """``text`` is a doorbell file's name in ``/dev/shm`` (no path: a client opens nothing else by it):
    ``DOORBELLS_PREFIX``, the server's pid (1 to 10 digits), ``-``, 24 lowercase hex digits."""
    if not text.startswith(DOORBELLS_PREFIX):
        return False
    pid, dash, random = text[len(DOORBELLS_PREFIX):].partition("-")
    return (bool(dash) and 1 <= len(pid) <= 10 and set(pid) <= _DIGITS and len(random) == 24
            and set(random) <= _HEX)


class DoorbellsName(WireType):
    """A doorbell file's name (``is_doorbells_name``)."""

    type_doc, plural_doc = "str", "str"
    limits_doc = "`code2wav-doorbells-`, the server's pid, `-`, 24 lowercase hex digits"

    def __init__(self) -> None:
        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> str:
            name = field_name(path, key)
            text = check_str(value, name, max_nbytes=64)
            if not is_doorbells_name(text):
                invalid(f"{name} must be a doorbell file's name ({DOORBELLS_PREFIX}<pid>-<24 lowercase hex "
                        f"digits>), got {text!r}")
            return text
        self.parse = parse


_EVENTS = ArrayOf(Handle(), MAX_REGION_EVENTS)
_REPLY = "the request's"


@message("register_region", sender="client")
class RegisterRegion:
    """Client -> server: export one device memory block; answered by ``region_registered``."""

    request_id: int = wire(UINT64, doc="chosen by the client, echoed in the reply")
    gpu_uuid: str = wire(Str(), doc="the block's GPU, `GPU-xxxxxxxx-...` as `nvidia-smi -L` prints it; must equal "
                                    "`welcome.capabilities.gpu_uuid`")
    ipc_handle: str = wire(Handle(), doc="the `cudaIpcMemHandle_t` of the block's start")
    nbytes: int = wire(Int(1, MAX_REGION_NBYTES), doc="the region's size; the server checks it against the real "
                                                      "allocation")
    access: str = wire(Choice(REGION_ACCESS), doc="`read`: the server reads codes from it; `write`: the server "
                                                  "writes audio into it")
    events: tuple[str, ...] = wire(_EVENTS, default=(), doc="the interprocess event handles "
                                                            "(`cudaIpcEventHandle_t`) the client records after "
                                                            "writing codes")

    @rule("A `read` region has 1..64 `events`; a `write` region none (the server creates its events).")
    def _events_by_access(self, path: str, limits: Any, frames: Any) -> None:
        if self.access == "write" and self.events:
            invalid(f"{path}.events must be empty for a write region (the server creates its events)")
        if self.access == "read" and not 1 <= len(self.events) <= MAX_REGION_EVENTS:
            invalid(f"{path}.events must hold 1..{MAX_REGION_EVENTS} event handles, got {len(self.events)}")


@message("unregister_region", sender="client")
class UnregisterRegion:
    """Client -> server: close a region; answered by ``region_unregistered`` once no chunk uses it."""

    request_id: int = wire(UINT64, doc="chosen by the client, echoed in the reply")
    region_id: int = wire(Int(0), doc="one of this connection's regions")


@message("region_registered", sender="server")
class RegionRegistered:
    """Server -> client: the region's id; for ``write`` regions the server's event handles."""

    request_id: int = wire(UINT64, doc=_REPLY)
    region_id: int = wire(Int(0), doc="what descriptors name as `region`")
    events: tuple[str, ...] = wire(_EVENTS, default=(), doc="`write` regions: the server's event handles (16 "
                                                            "today), which results name in `audio_event`")
    doorbells: str | None = wire(Nullable(DoorbellsName()), default=None, omit_default=True,
                                 doc="`read` regions of a server that arms steps: the name of its doorbell words, a "
                                     "file in `/dev/shm` (shared host memory both processes map and register for "
                                     "the GPU), one 32-bit word per registered event (zero at first), which armed "
                                     "chunks name (`codes_event`, `codes_token`)")


@message("region_unregistered", sender="server")
class RegionUnregistered:
    """Server -> client: the region is closed."""

    request_id: int = wire(UINT64, doc=_REPLY)
    region_id: int = wire(Int(0), doc="the closed region")
