"""Server -> client messages of wire protocol v1 (the CUDA IPC region replies are in ``ipc.py``).

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing
outside ``proto``. Each message is a frozen dataclass with its ``TYPE`` and its
wire form (``to_wire``); parsing and validation live in ``_decode_client.py`` and
``_decode_server.py``, the table of all messages in ``messages.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._flat import FlatMessage
from .errors import ErrorCode
from .limits import DEFAULT_LIMITS, Limits
from .tensors import TensorDesc

__all__ = ["StreamOptionInfo", "ModelInfo", "Welcome", "Opened", "ErrorInfo", "ChunkResult", "DecodeResult",
           "Finished", "Aborted", "Pong", "Error"]


@dataclass(frozen=True)
class StreamOptionInfo:
    """An integer option a stream of this model may set in ``open_stream.options`` (range inclusive)."""

    name: str
    low: int
    high: int
    default: int

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "low": self.low, "high": self.high, "default": self.default}


@dataclass(frozen=True)
class ModelInfo:
    """A served model and its input contract (proto/README.md, "welcome"). ``num_quantizers`` is the inputs'
    first dimension (Q codes or D latent channels, same as ``input_channels``); ``codebook_size`` is 0 for
    latents. The contract fields default to a codes model's values for servers that do not send them."""

    name: str
    num_quantizers: int
    codebook_size: int
    samples_per_frame: int
    sample_rate: int
    modes: tuple[str, ...]
    dtype: str
    device: str
    family: str = ""
    input_kind: str = "codes"  # "codes": integers [Q, n] in input_range; "latents": finite floats [D, n]
    input_dtypes: tuple[str, ...] = ("int16", "int32", "int64")
    input_channels: int = 0  # 0: num_quantizers (a server before the contract fields)
    input_range: tuple[int, int] | None = None  # [low, high) of codes; None: latents, or [0, codebook_size)
    stream_options: tuple[StreamOptionInfo, ...] = ()

    @property
    def channels(self) -> int:
        return self.input_channels or self.num_quantizers

    @property
    def valid_range(self) -> tuple[int, int] | None:
        if self.input_kind != "codes":
            return None
        return self.input_range or (0, self.codebook_size)

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
            "family": self.family,
            "input_kind": self.input_kind,
            "input_dtypes": list(self.input_dtypes),
            "input_channels": self.input_channels,  # 0: num_quantizers
            "input_range": None if self.input_range is None else list(self.input_range),
            "stream_options": [option.to_wire() for option in self.stream_options],
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
    session_secret: str | None = None
    """Binds the session to this client: a later ``hello`` on the same routing id must present it."""

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
            **({} if self.session_secret is None else {"session_secret": self.session_secret}),
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
class Finished(FlatMessage):
    TYPE: ClassVar[str] = "finished"
    request_id: int
    stream_id: str


@dataclass(frozen=True)
class Aborted(FlatMessage):
    TYPE: ClassVar[str] = "aborted"
    request_id: int
    stream_id: str


@dataclass(frozen=True)
class Pong(FlatMessage):
    TYPE: ClassVar[str] = "pong"
    request_id: int
    boot_epoch: str


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
