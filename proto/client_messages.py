"""Client -> server messages of wire protocol v1 (the CUDA IPC region messages are in ``ipc.py``).

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing
outside ``proto``. Each message is a frozen dataclass with its ``TYPE`` and its
wire form (``to_wire``); parsing and validation live in ``_decode_client.py`` and
``_decode_server.py``, the table of all messages in ``messages.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._flat import FlatMessage
from .tensors import TensorDesc

__all__ = ["Hello", "OpenStream", "Chunk", "Decode", "Finish", "Abort", "Ping", "Bye"]


@dataclass(frozen=True)
class Hello:
    """First message of a connection. capabilities: ``cuda_ipc: bool``, ``gpu_uuid: str | None``,
    ``host_id: str | None`` (the kernel boot id: equal ids mean the same host)."""

    TYPE: ClassVar[str] = "hello"
    request_id: int
    version: int
    client_id: str
    capabilities: dict[str, Any] = field(default_factory=dict)
    session_secret: str | None = None
    """A re-handshake on a connection (routing id) that has a session presents that session's secret (from
    its ``welcome``); omitted on the wire when None."""

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "type": self.TYPE,
            "request_id": self.request_id,
            "version": self.version,
            "client_id": self.client_id,
            "capabilities": dict(self.capabilities),
        }
        if self.session_secret is not None:
            wire["session_secret"] = self.session_secret
        return wire


@dataclass(frozen=True)
class OpenStream:
    """Open a stream; ``model=None`` means the server's default model."""

    TYPE: ClassVar[str] = "open_stream"
    request_id: int
    stream_id: str
    model: str | None = None
    mode: str = "exact"
    left_context_frames: int = 0
    options: dict[str, int] = field(default_factory=dict)  # the model's stream_options (welcome); the server checks

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "type": self.TYPE,
            "request_id": self.request_id,
            "stream_id": self.stream_id,
            "model": self.model,
            "mode": self.mode,
            "left_context_frames": self.left_context_frames,
        }
        if self.options:  # absent when empty: servers before stream options accept the message unchanged
            wire["options"] = dict(self.options)
        return wire


@dataclass(frozen=True)
class Chunk:
    """``codes`` is an integer tensor ``[Q, n]``; its first ``context_frames`` frames give no audio.

    CUDA IPC (see ``ipc.py``): ``codes_event`` names the event of the codes' region recorded after the
    codes were written (required for ``cuda_ipc`` codes, absent otherwise); ``audio_out`` asks the server
    to write the audio into a ``write`` region (float32 ``[(n - context_frames) * U]``).
    """

    stream_id: str
    seq: int
    codes: TensorDesc
    final: bool = False
    context_frames: int = 0
    codes_event: int | None = None
    audio_out: TensorDesc | None = None

    @property
    def num_frames(self) -> int:
        """``n``, the codec frames in this chunk (context frames included)."""
        return self.codes.shape[1]

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "stream_id": self.stream_id,
            "seq": self.seq,
            "codes": self.codes.to_wire(),
            "final": self.final,
            "context_frames": self.context_frames,
        }
        if self.codes_event is not None:
            wire["codes_event"] = self.codes_event
        if self.audio_out is not None:
            wire["audio_out"] = self.audio_out.to_wire()
        return wire


@dataclass(frozen=True)
class Decode:
    """One or more chunks, of one or many streams, decoded in one round trip."""

    TYPE: ClassVar[str] = "decode"
    request_id: int
    chunks: tuple[Chunk, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "request_id": self.request_id,
            "chunks": [chunk.to_wire() for chunk in self.chunks],
        }


@dataclass(frozen=True)
class Finish(FlatMessage):
    """Close a stream gracefully once its queued chunks are done."""

    TYPE: ClassVar[str] = "finish"
    request_id: int
    stream_id: str


@dataclass(frozen=True)
class Abort(FlatMessage):
    """Drop a stream's queued chunks and free its state now."""

    TYPE: ClassVar[str] = "abort"
    request_id: int
    stream_id: str


@dataclass(frozen=True)
class Ping(FlatMessage):
    """Heartbeat; answered with ``Pong`` (even before ``hello``)."""

    TYPE: ClassVar[str] = "ping"
    request_id: int


@dataclass(frozen=True)
class Bye(FlatMessage):
    """The client is going away; the server frees all its streams. No reply."""

    TYPE: ClassVar[str] = "bye"
    request_id: int
