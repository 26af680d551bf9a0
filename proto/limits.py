"""Protocol limits: what a server accepts (sent to clients in ``welcome``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``.
"""

from __future__ import annotations

from .declare import record, wire
from .wire_types import Int

__all__ = ["Limits", "DEFAULT_LIMITS", "MiB", "exceeded_limit"]

MiB = 1024 * 1024


@record("limits", sender="server")
class Limits:
    """Bounds enforced by the decoders; all counts are inclusive maxima. A server sends its own in ``welcome``;
    a client reads the ones it gets leniently (unknown keys ignored, missing ones keep these defaults)."""

    max_message_bytes: int = wire(Int(1), default=64 * MiB, doc="sum of the sizes of all frames of one message")
    max_header_bytes: int = wire(Int(1), default=1 * MiB, doc="size of frame 0 (the msgpack header)")
    max_frames_per_message: int = wire(Int(1), default=1025, doc="the header plus one tensor frame per chunk")
    max_chunks_per_message: int = wire(Int(1), default=1024, doc="entries of `decode.chunks`")
    max_tensor_elements: int = wire(Int(1), default=64 * 1024 * 1024,
                                    doc="elements of any one tensor (bounds CUDA IPC tensors, which the byte "
                                        "limit does not)")
    max_rank: int = wire(Int(1), default=4, doc="rank of any tensor")
    max_id_len: int = wire(Int(1), default=256,
                           doc="UTF-8 bytes of stream ids, client ids, model names, server ids, boot epochs")
    max_chunk_frames: int = wire(Int(1), default=8192, doc="codec frames (`n`) in one chunk")
    max_left_context_frames: int = wire(Int(0), default=1024, doc="`open_stream.left_context_frames`")

    @classmethod
    def from_wire(cls, obj: object) -> Limits:
        """Parse limits sent by a server: unknown keys are ignored, missing keys keep defaults."""
        return cls.WIRE.parse(obj, "limits", "", None, ())  # type: ignore[attr-defined]


DEFAULT_LIMITS = Limits()


def exceeded_limit(frames: list, limits: Limits) -> tuple[str, str] | None:
    """``(limit name, message)`` for the first of the message-size limits an encoded message breaks, else None:
    what a sender checks before sending (a server answers these with ``invalid_argument``)."""
    nbytes = [memoryview(frame).nbytes for frame in frames]
    if len(frames) > limits.max_frames_per_message:
        return "max_frames_per_message", (f"message has {len(frames)} frames; the server's limit is "
                                          f"{limits.max_frames_per_message} (max_frames_per_message)")
    if nbytes and nbytes[0] > limits.max_header_bytes:
        return "max_header_bytes", (f"header is {nbytes[0]} bytes; the server's limit is {limits.max_header_bytes} "
                                    "(max_header_bytes)")
    if sum(nbytes) > limits.max_message_bytes:
        return "max_message_bytes", (f"message is {sum(nbytes)} bytes; the server's limit is "
                                     f"{limits.max_message_bytes} (max_message_bytes)")
    return None
