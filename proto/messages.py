"""Message types of wire protocol v1 (plain frozen dataclasses) and their wire form.

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing
outside ``proto``. Decoding and validation live in ``codec.py``; this module
only says what each message holds and how it is written (``to_wire``).

Every message carries ``request_id`` (a uint64 the client chooses; the server
echoes it in the reply). The header key ``"type"`` names the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from .errors import ErrorCode
from .ipc import RegionRegistered, RegionUnregistered, RegisterRegion, UnregisterRegion
from .limits import DEFAULT_LIMITS, Limits
from .tensors import TensorDesc

__all__ = [
    "PROTOCOL_VERSION",
    "STREAM_MODES",
    "DEFAULT_LEFT_CONTEXT_FRAMES",
    "Limits",
    "Hello",
    "OpenStream",
    "Chunk",
    "Decode",
    "Finish",
    "Abort",
    "Ping",
    "Bye",
    "ModelInfo",
    "Welcome",
    "Opened",
    "ErrorInfo",
    "ChunkResult",
    "DecodeResult",
    "Finished",
    "Aborted",
    "Pong",
    "Error",
    "ClientMessage",
    "ServerMessage",
]

PROTOCOL_VERSION = 1
STREAM_MODES: tuple[str, ...] = ("exact", "window")
DEFAULT_LEFT_CONTEXT_FRAMES = 25
"""What clients send for ``window`` mode unless told otherwise (vLLM-Omni's default)."""


# --------------------------------------------------------------------------- client -> server


@dataclass(frozen=True)
class Hello:
    """First message of a connection. capabilities: ``cuda_ipc: bool``, ``gpu_uuid: str | None``,
    ``host_id: str | None`` (the kernel boot id: equal ids mean the same host)."""

    TYPE: ClassVar[str] = "hello"
    request_id: int
    version: int
    client_id: str
    capabilities: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "request_id": self.request_id,
            "version": self.version,
            "client_id": self.client_id,
            "capabilities": dict(self.capabilities),
        }


@dataclass(frozen=True)
class OpenStream:
    """Open a stream; ``model=None`` means the server's default model. ``options``: per-stream model options
    with scalar values, fixed for the stream's life (e.g. ``{"sr_cond": 16000}`` for VoxCPM2; empty: none)."""

    TYPE: ClassVar[str] = "open_stream"
    request_id: int
    stream_id: str
    model: str | None = None
    mode: str = "exact"
    left_context_frames: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "type": self.TYPE,
            "request_id": self.request_id,
            "stream_id": self.stream_id,
            "model": self.model,
            "mode": self.mode,
            "left_context_frames": self.left_context_frames,
        }
        if self.options:  # absent when empty: servers without options support still accept the message
            wire["options"] = dict(self.options)
        return wire


@dataclass(frozen=True)
class Chunk:
    """``codes`` is an integer tensor ``[Q, n]`` (or, for a latents model, float32/bfloat16 latents ``[D, n]``);
    its first ``context_frames`` frames give no audio.

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
class Finish:
    """Close a stream gracefully once its queued chunks are done."""

    TYPE: ClassVar[str] = "finish"
    request_id: int
    stream_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id, "stream_id": self.stream_id}


@dataclass(frozen=True)
class Abort:
    """Drop a stream's queued chunks and free its state now."""

    TYPE: ClassVar[str] = "abort"
    request_id: int
    stream_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id, "stream_id": self.stream_id}


@dataclass(frozen=True)
class Ping:
    """Heartbeat; answered with ``Pong`` (even before ``hello``)."""

    TYPE: ClassVar[str] = "ping"
    request_id: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id}


@dataclass(frozen=True)
class Bye:
    """The client is going away; the server frees all its streams. No reply."""

    TYPE: ClassVar[str] = "bye"
    request_id: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id}


# --------------------------------------------------------------------------- server -> client


@dataclass(frozen=True)
class ModelInfo:
    name: str
    num_quantizers: int
    codebook_size: int
    samples_per_frame: int
    sample_rate: int
    modes: tuple[str, ...]
    dtype: str
    device: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_quantizers": self.num_quantizers,
            "codebook_size": self.codebook_size,
            "samples_per_frame": self.samples_per_frame,
            "sample_rate": self.sample_rate,
            "modes": list(self.modes),
            "dtype": self.dtype,
            "device": self.device,
        }


@dataclass(frozen=True)
class Welcome:
    """Reply to ``Hello``."""

    TYPE: ClassVar[str] = "welcome"
    request_id: int
    version: int
    server_id: str
    boot_epoch: str
    models: tuple[ModelInfo, ...]
    default_model: str
    limits: Limits = DEFAULT_LIMITS
    heartbeat_interval_s: float = 0.5
    capabilities: dict[str, Any] = field(default_factory=dict)

    def model(self, name: str | None) -> ModelInfo | None:
        """The model called ``name`` (the default model for ``None``), if served."""
        wanted = self.default_model if name is None else name
        for info in self.models:
            if info.name == wanted:
                return info
        return None

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "request_id": self.request_id,
            "version": self.version,
            "server_id": self.server_id,
            "boot_epoch": self.boot_epoch,
            "models": [info.to_wire() for info in self.models],
            "default_model": self.default_model,
            "limits": self.limits.to_wire(),
            "heartbeat_interval_s": float(self.heartbeat_interval_s),
            "capabilities": dict(self.capabilities),
        }


@dataclass(frozen=True)
class Opened:
    """Reply to ``OpenStream``: the parameters in effect for the stream."""

    TYPE: ClassVar[str] = "opened"
    request_id: int
    stream_id: str
    model: str
    mode: str
    left_context_frames: int
    samples_per_frame: int
    num_quantizers: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "request_id": self.request_id,
            "stream_id": self.stream_id,
            "model": self.model,
            "mode": self.mode,
            "left_context_frames": self.left_context_frames,
            "samples_per_frame": self.samples_per_frame,
            "num_quantizers": self.num_quantizers,
        }


@dataclass(frozen=True)
class ErrorInfo:
    code: ErrorCode
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message}


@dataclass(frozen=True)
class ChunkResult:
    """Outcome of one chunk: exactly one of ``audio`` (float32 ``[num_samples]``) and ``error``.

    ``num_frames`` is the number of frames that produced audio (``n - context_frames``;
    0 on error), so ``num_samples == num_frames * samples_per_frame``. ``audio_event`` (cuda_ipc audio
    only) names the event of the audio's region that the server recorded after writing it; the result may
    arrive before that event completes, so readers wait on it first.
    """

    stream_id: str
    seq: int
    audio: TensorDesc | None
    num_frames: int
    error: ErrorInfo | None = None
    audio_event: int | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "stream_id": self.stream_id,
            "seq": self.seq,
            "num_frames": self.num_frames,
            "audio": None if self.audio is None else self.audio.to_wire(),
            "error": None if self.error is None else self.error.to_wire(),
        }
        if self.audio_event is not None:
            wire["audio_event"] = self.audio_event
        return wire


@dataclass(frozen=True)
class DecodeResult:
    """Reply to ``Decode``: one result per chunk, in the chunks' order."""

    TYPE: ClassVar[str] = "decode_result"
    request_id: int
    results: tuple[ChunkResult, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "request_id": self.request_id,
            "results": [result.to_wire() for result in self.results],
        }


@dataclass(frozen=True)
class Finished:
    TYPE: ClassVar[str] = "finished"
    request_id: int
    stream_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id, "stream_id": self.stream_id}


@dataclass(frozen=True)
class Aborted:
    TYPE: ClassVar[str] = "aborted"
    request_id: int
    stream_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id, "stream_id": self.stream_id}


@dataclass(frozen=True)
class Pong:
    TYPE: ClassVar[str] = "pong"
    request_id: int
    boot_epoch: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "request_id": self.request_id, "boot_epoch": self.boot_epoch}


@dataclass(frozen=True)
class Error:
    """Message-level error; ``request_id`` is None when the request's id could not be read."""

    TYPE: ClassVar[str] = "error"
    request_id: int | None
    code: ErrorCode
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "request_id": self.request_id,
            "code": self.code.value,
            "message": self.message,
        }


ClientMessage = Union[Hello, OpenStream, Decode, Finish, Abort, Ping, Bye, RegisterRegion, UnregisterRegion]
ServerMessage = Union[Welcome, Opened, DecodeResult, Finished, Aborted, Pong, Error, RegionRegistered,
                      RegionUnregistered]
