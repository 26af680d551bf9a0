"""Exceptions raised by the client: one class per protocol error code.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

from code2wav.proto import ErrorCode

__all__ = [
    "SidecarError",
    "InvalidArgument",
    "LimitExceeded",
    "NotFound",
    "AlreadyExists",
    "OutOfOrder",
    "Busy",
    "DeadlineExceeded",
    "Unavailable",
    "Internal",
    "VersionMismatch",
    "StreamLost",
    "SidecarNotRunning",
    "not_running",
    "error_from",
]


class SidecarError(Exception):
    """Base class; ``code`` is the protocol ``ErrorCode``, ``message`` the server's text."""

    code: ErrorCode = ErrorCode.INTERNAL
    failed_seq: int | None = None
    """A chunk's error for an earlier chunk of its stream that was answered with early audio and refused after
    its reply (proto/README.md section 5): that chunk's seq, where the stream continues (send it again)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)  # args stay (message,), so errors pickle and re-raise intact
        self.message: str = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class InvalidArgument(SidecarError):
    code = ErrorCode.INVALID_ARGUMENT


class LimitExceeded(InvalidArgument):
    """Raised before sending: the message breaks one of the server's ``welcome.limits``, named by ``limit``."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class NotFound(SidecarError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(SidecarError):
    code = ErrorCode.ALREADY_EXISTS


class OutOfOrder(SidecarError):
    code = ErrorCode.OUT_OF_ORDER


class Busy(SidecarError):
    code = ErrorCode.BUSY


class DeadlineExceeded(SidecarError):
    """The reply did not arrive in time. The outcome on the server is unknown."""

    code = ErrorCode.DEADLINE_EXCEEDED


class Unavailable(SidecarError):
    """The server is unreachable, stopped answering heartbeats, or is shutting down."""

    code = ErrorCode.UNAVAILABLE


class SidecarNotRunning(Unavailable):
    """No sidecar answered the handshake within ``connect_timeout_s``: none runs at that address (or it is
    still starting). The message names the address and the command that starts one."""


def not_running(address: str, connect_timeout_s: float, socket_exists: bool | None = None) -> SidecarNotRunning:
    """The error for a sidecar that is not there. ``socket_exists``: for ipc:// addresses, whether the socket
    file is there (None: not an ipc:// address); False is known before any wait, so it names no timeout."""
    if socket_exists is False:
        what = (f"no code2wav sidecar is listening at {address}: the socket file {address[len('ipc://'):]} "
                "does not exist")
    elif socket_exists:
        what = (f"no code2wav sidecar answered at {address} within {connect_timeout_s:g}s: its socket file exists "
                "but no server answered (a crashed or stopped sidecar, or one still starting)")
    else:
        what = (f"no code2wav sidecar answered at {address} within {connect_timeout_s:g}s: nothing answered (not "
                "started, still starting, or a firewall or CurveZMQ key mismatch)")
    return SidecarNotRunning(
        f"{what}. Start one with `code2wav-sidecar serve --address {address}` (with no --address both sides use "
        "the same default), or pass the address a running one printed in its ready line")


class Internal(SidecarError):
    code = ErrorCode.INTERNAL


class VersionMismatch(SidecarError):
    code = ErrorCode.VERSION_MISMATCH


class StreamLost(SidecarError):
    """The server restarted (its boot epoch changed): streams opened before are gone."""

    code = ErrorCode.STREAM_LOST


_BY_CODE: dict[ErrorCode, type[SidecarError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        OutOfOrder,
        Busy,
        DeadlineExceeded,
        Unavailable,
        Internal,
        VersionMismatch,
        StreamLost,
    )
}


def error_from(code: ErrorCode | str, message: str, failed_seq: int | None = None) -> SidecarError:
    """The exception for ``code`` (an unknown code string gives ``Internal``); ``failed_seq``: see
    ``SidecarError.failed_seq``."""
    try:
        error = _BY_CODE[ErrorCode(code)](message)
    except ValueError:
        error = Internal(f"[unknown error code {code!r}] {message}")
    if failed_seq is not None:
        error.failed_seq = failed_seq
    return error
