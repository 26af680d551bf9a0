"""The sidecar's load, as ``pong`` and ``welcome`` carry it (an optional addition to protocol v1, ``load``
version 1): what a client pool places new streams by (``client/placement.py``).

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing outside ``proto``. Parsed
leniently, like every server -> client map: a newer server may add keys; a server that predates the map sends
no ``load`` key at all (the field reads nil), and a client must cope with that (it then knows no load).
"""

from __future__ import annotations

from .declare import record, wire
from .wire_types import Bool, Int, NonNegativeFloat

__all__ = ["LOAD_VERSION", "Load"]

LOAD_VERSION = 1
"""The version of the load map this code speaks: ``welcome.capabilities.load`` names it when the server sends
``load`` (a later version may add keys; it keeps these)."""


@record("load", sender="server")
class Load:
    """The sidecar's load when it sent the message: its open streams, what it can still open, its queue, how long
    its recent engine steps took, and whether it is draining (refusing new streams)."""

    open_streams: int = wire(Int(0), doc="streams open now, of every client")
    free_slots: int = wire(Int(0), doc="state slots free now: how many more stateful (`exact`) streams it can "
                                       "open before `open_stream` is answered `busy`")
    queued_chunks: int = wire(Int(0), doc="chunks queued or in the engine, of every client")
    step_s: float = wire(NonNegativeFloat(), doc="a recent engine step's duration in seconds (an exponential "
                                                 "average over steps; 0 before the first step)")
    draining: bool = wire(Bool(), doc="the server is stopping: `open_stream` is answered `unavailable`")

    @property
    def capacity_slots(self) -> int:
        """Streams it could hold in all: the open ones and the free slots."""
        return self.open_streams + self.free_slots
