"""Protocol limits: what a server accepts (sent to clients in ``welcome``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ._check import as_map, check_int

__all__ = ["Limits", "DEFAULT_LIMITS", "MiB", "exceeded_limit"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Bounds enforced by the decoders; all counts are inclusive maxima."""

    max_message_bytes: int = 64 * MiB
    """Sum of the sizes of all frames of one message."""
    max_header_bytes: int = 1 * MiB
    """Size of frame 0 (the msgpack header)."""
    max_frames_per_message: int = 1025
    """Header plus one tensor frame per chunk."""
    max_chunks_per_message: int = 1024
    max_tensor_elements: int = 64 * 1024 * 1024
    """Element count of any one tensor (bounds CUDA IPC tensors, which the byte limit does not)."""
    max_rank: int = 4
    max_id_len: int = 256
    """UTF-8 bytes of stream ids, client ids, model names, server ids, boot epochs."""
    max_chunk_frames: int = 8192
    """Codec frames (``n``) in one chunk."""
    max_left_context_frames: int = 1024

    def to_wire(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: object) -> Limits:
        """Parse limits sent by a server: unknown keys are ignored, missing keys keep defaults."""
        mapping: dict[str, Any] = as_map(obj, "limits")
        values: dict[str, int] = {}
        for field in fields(cls):
            if field.name in mapping:
                lowest = 0 if field.name == "max_left_context_frames" else 1
                values[field.name] = check_int(
                    mapping[field.name], f"limits.{field.name}", lo=lowest, hi=2**63 - 1
                )
        return cls(**values)


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
