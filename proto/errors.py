"""Error codes of wire protocol v1 and the exception that carries them.

Rules for every module in ``proto/``: sans-IO (no sockets, no threads, no clocks);
imports only the standard library and ``msgpack``; never imports zmq, torch,
numpy, or any other package of this project (``client`` and ``sidecar`` import
``proto``, never the other way round).
"""

from __future__ import annotations

import enum

__all__ = ["ErrorCode", "ProtocolError"]


class ErrorCode(str, enum.Enum):
    """Typed error codes; the string value is what travels on the wire."""

    INVALID_ARGUMENT = "invalid_argument"
    """Malformed message or field, a value out of range, a limit exceeded, no hello yet."""
    NOT_FOUND = "not_found"
    """Unknown (or already freed) stream id, unknown model."""
    ALREADY_EXISTS = "already_exists"
    """``open_stream`` with a stream id this client already has open."""
    OUT_OF_ORDER = "out_of_order"
    """A chunk whose seq is neither the next one nor a resend of the last one."""
    BUSY = "busy"
    """The server is at capacity (streams, queued chunks); retry later."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The work did not finish in time (client-side timeouts use it too)."""
    UNAVAILABLE = "unavailable"
    """The server is shutting down or unreachable (client: heartbeats lost)."""
    INTERNAL = "internal"
    """A bug or a device failure on the server; the message says what."""
    VERSION_MISMATCH = "version_mismatch"
    """``hello`` carried a protocol version the server does not speak."""
    STREAM_LOST = "stream_lost"
    """Client-side only: the server's boot epoch changed, old streams are gone."""


class ProtocolError(Exception):
    """A typed protocol error, scoped to ``request_id`` when it could be read."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code: ErrorCode = code
        self.message: str = message
        self.request_id: int | None = request_id

    def with_request_id(self, request_id: int | None) -> ProtocolError:
        """Return this error scoped to ``request_id`` (self if nothing changes)."""
        if request_id is None or self.request_id is not None:
            return self
        return ProtocolError(self.code, self.message, request_id)

    def __repr__(self) -> str:
        return (
            f"ProtocolError(code={self.code.value!r}, message={self.message!r}, "
            f"request_id={self.request_id!r})"
        )
