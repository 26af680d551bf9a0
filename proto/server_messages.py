"""Server -> client messages of wire protocol v1, each declared once (``welcome``: ``server_welcome.py``; the
CUDA IPC region replies: ``ipc.py``).

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing outside ``proto``. Parsed
leniently: unknown keys are ignored (a newer server may add fields), known ones are checked. An error code this
version does not know reads as INTERNAL, with the original code kept in the message.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._check import invalid
from .constants import MAX_REGION_EVENTS
from .declare import message, record, rule, wire
from .errors import ErrorCode, ProtocolError
from .load import Load
from .server_welcome import ModelInfo, StreamOptionInfo, Welcome
from .tensors import CudaIpcLoc, InlineLoc, TensorDesc, TensorField, inline_view
from .wire_containers import ArrayOf, Nullable
from .wire_types import UINT64, ErrorCodeField, Int, Str, UnknownErrorCode

__all__ = ["StreamOptionInfo", "ModelInfo", "Welcome", "Opened", "ErrorInfo", "ChunkResult", "DecodeResult",
           "Finished", "Aborted", "Pong", "Error"]

_TEXT = Str("max_header_bytes", empty=True)
_REPLY = "the request's"
_UNKNOWN_CODE = "An unknown `code` reads as `internal`, the message starting `[server error code '<code>'] `."


def _internal_for_unknown_code(error: Any, path: str, limits: Any, frames: Any) -> Any:
    if type(error.code) is UnknownErrorCode:
        return dataclasses.replace(error, code=ErrorCode.INTERNAL,
                                   message=f"[server error code {str(error.code)!r}] {error.message}")
    return None


@message("opened", sender="server")
class Opened:
    """Reply to ``OpenStream``: the parameters in effect for the stream."""

    request_id: int = wire(UINT64, doc=_REPLY)
    stream_id: str = wire(Str(), doc="the `open_stream`'s")
    model: str = wire(Str(), doc="the model's name (the default model's for nil)")
    mode: str = wire(Str(), doc="the stream's mode")
    left_context_frames: int = wire(Int(0), doc="in effect (0 in exact mode)")
    samples_per_frame: int = wire(Int(1), doc="`U`")
    num_quantizers: int = wire(Int(1), doc="`Q`")


@record("error", sender="server")
class ErrorInfo:
    """A chunk's failure: its typed code and what happened."""

    code: ErrorCode = wire(ErrorCodeField(), doc="what failed (section 7)")
    message: str = wire(_TEXT, doc="for people")
    failed_seq: int | None = wire(
        Nullable(Int(0)), default=None, omit_default=True,
        doc="set when this chunk is refused because an earlier chunk of its stream, answered with early audio, "
            "was refused after its reply (section 5, early audio): that chunk's seq; `code` is its, `message` quotes it. "
            "The stream continues from `failed_seq`")

    _unknown_code = rule(_UNKNOWN_CODE)(_internal_for_unknown_code)


@record("result", sender="server", order=("stream_id", "seq", "num_frames", "audio", "error", "audio_event"))
class ChunkResult:
    """Outcome of one chunk: exactly one of ``audio`` (float32 ``[num_samples]``) and ``error``.

    ``num_frames`` is the number of frames that produced audio (``n - context_frames``;
    0 on error), so ``num_samples == num_frames * samples_per_frame``. ``audio_event`` (cuda_ipc audio
    only) names the event of the audio's region that the server recorded after writing it; the result may
    arrive before that event completes, so readers wait on it first.
    """

    stream_id: str = wire(Str(), doc="echoes the chunk")
    seq: int = wire(Int(0), doc="echoes the chunk")
    audio: TensorDesc | None = wire(
        Nullable(TensorField()), absent=None,
        doc="`float32` `[num_frames * U]` samples at `sample_rate`, mono, range about [-1, 1]")
    num_frames: int = wire(Int(0), absent=0, doc="frames that produced audio: `n - context_frames` (0 on error)")
    error: ErrorInfo | None = wire(Nullable(ErrorInfo), default=None, doc="why the chunk failed")
    audio_event: int | None = wire(
        Nullable(Int(0, MAX_REGION_EVENTS - 1)), default=None, omit_default=True,
        doc="the event of the audio's region the server recorded after writing it; wait on it before reading "
            "(the result does not wait for it)")

    @rule("Exactly one of `audio` and `error` is non-nil.")
    def _audio_or_error(self, path: str, limits: Any, frames: Any) -> None:
        if (self.audio is None) == (self.error is None):
            invalid(f"{path} must carry exactly one of 'audio' and 'error'")

    @rule("`audio` is `float32` rank 1; inline, its frame holds exactly its bytes.")
    def _audio(self, path: str, limits: Any, frames: Any) -> None:
        audio = self.audio
        if audio is None:
            return
        try:
            if audio.dtype != "float32" or len(audio.shape) != 1:
                invalid(f"audio must be float32 [num_samples], got {audio.dtype} {list(audio.shape)}")
            if type(audio.loc) is InlineLoc:
                inline_view(audio, frames)
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{path}.audio: {exc.message}") from None

    @rule("`audio_event` is required when `audio` is `cuda_ipc` (and ignored otherwise).")
    def _audio_event(self, path: str, limits: Any, frames: Any) -> Any:
        is_ipc = self.audio is not None and isinstance(self.audio.loc, CudaIpcLoc)
        if is_ipc and self.audio_event is None:
            invalid(f"{path} is missing required key 'audio_event'")
        if not is_ipc and self.audio_event is not None:
            return dataclasses.replace(self, audio_event=None)
        return None


@message("decode_result", sender="server")
class DecodeResult:
    """Reply to ``Decode``: one result per chunk, in the chunks' order."""

    request_id: int = wire(UINT64, doc=_REPLY)
    results: tuple[ChunkResult, ...] = wire(ArrayOf(ChunkResult, "max_chunks_per_message"),
                                            doc="one per chunk, in the chunks' order")


@message("finished", sender="server")
class Finished:
    """Reply to ``Finish``: the stream is closed."""

    request_id: int = wire(UINT64, doc=_REPLY)
    stream_id: str = wire(Str(), doc="the finished stream")


@message("aborted", sender="server")
class Aborted:
    """Reply to ``Abort``: the stream is gone."""

    request_id: int = wire(UINT64, doc=_REPLY)
    stream_id: str = wire(Str(), doc="the aborted stream")


@message("pong", sender="server")
class Pong:
    """Reply to ``Ping``."""

    request_id: int = wire(UINT64, doc=_REPLY)
    boot_epoch: str = wire(Str(), doc="the server's (section 6): another one than the handshake's means a restart")
    load: Load | None = wire(Nullable(Load), default=None, omit_default=True,
                             doc="the server's load now (load map below; section 10); nil or absent from a server "
                                 "that does not report it")


@message("error", sender="server")
class Error:
    """Message-level error; ``request_id`` is None when the request's id could not be read."""

    request_id: int | None = wire(Nullable(UINT64), doc="the request's; nil only when it could not be read (bad "
                                                        "framing, bad msgpack)")
    code: ErrorCode = wire(ErrorCodeField(), doc="what failed (section 7)")
    message: str = wire(_TEXT, doc="for people")
    failed_seq: int | None = wire(
        Nullable(Int(0)), default=None, omit_default=True,
        doc="a `finish` refused because a chunk of its stream answered with early audio was refused after its "
            "reply (section 5, early audio): that chunk's seq, where the stream continues")

    _unknown_code = rule(_UNKNOWN_CODE)(_internal_for_unknown_code)
