"""A request in flight between a caller and the I/O thread (see ``_io.py``).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from code2wav.proto import Limits, ServerMessage

from .errors import SidecarError

__all__ = ["Call", "OnFailure", "OnReply", "Outcome", "RECEIVE_LIMITS"]

RECEIVE_LIMITS = Limits(
    max_message_bytes=1 << 40,
    max_header_bytes=64 << 20,
    max_frames_per_message=1 << 20,
    max_chunks_per_message=1 << 20,
    max_tensor_elements=1 << 40,
    max_id_len=4096,
)
"""We trust the server's sizes; these bounds only guard against garbage."""

OnReply = Callable[[ServerMessage, list[memoryview]], None]
Outcome = Literal["not_sent", "rejected", "unknown"]
"""How a call failed: never left the client; the server answered with an error; or it was sent
and no answer came (it may or may not have been applied)."""
OnFailure = Callable[[SidecarError, Outcome], None]


@dataclass(eq=False)
class Call:
    """One request in flight. Callbacks run on the I/O thread and must not block."""

    request_id: int
    frames: list[Any]
    timeout_s: float
    on_reply: OnReply
    on_failure: OnFailure
    generation: int | None = None
    """For calls on streams: the generation the streams were opened in."""
    internal: bool = False
    deadline: float = 0.0
    sent_seq: int = 0
    """Its place in the order of messages this connection sent (1, 2, ...; 0 while unsent)."""
    stamps: Any = None
    """A traced decode call's ``call_trace.CallStamps`` (sent, reply received); None: not traced."""

    @property
    def sent(self) -> bool:
        return self.sent_seq > 0
