"""Parsers for server -> client headers (private to ``proto``; used by ``codec``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. Lenient about
unknown keys (a newer server may add fields) but strict about the types and
ranges of the fields it reads. An error code this version does not know maps
to INTERNAL, with the original code kept in the message.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._check import (
    INT64_MAX,
    UINT64_MAX,
    as_map,
    check_int,
    check_str,
    get_int,
    get_optional_str,
    get_list,
    get_positive_float,
    get_str,
    invalid,
    require,
    type_name,
)
from .errors import ErrorCode, ProtocolError
from .limits import Limits
from .messages import (
    Aborted,
    ChunkResult,
    DecodeResult,
    Error,
    ErrorInfo,
    Finished,
    ModelInfo,
    Opened,
    Pong,
    StreamOptionInfo,
    Welcome,
)
from .ipc import MAX_REGION_EVENTS
from .tensors import InlineLoc, TensorDesc, inline_view

_MAX_MODELS = 256
_MAX_MODES = 16


def _request_id(header: dict[str, Any], what: str) -> int:
    return get_int(header, "request_id", what, lo=0, hi=UINT64_MAX)


def _id(obj: dict[str, Any], key: str, what: str, limits: Limits) -> str:
    return get_str(obj, key, what, max_nbytes=limits.max_id_len)


def _text(obj: dict[str, Any], key: str, what: str, limits: Limits) -> str:
    return get_str(obj, key, what, max_nbytes=limits.max_header_bytes, allow_empty=True)


def _error_code(value: object) -> tuple[ErrorCode, str]:
    """Return (code, prefix for the message); unknown codes become INTERNAL."""
    if not isinstance(value, str):
        invalid(f"error code must be a string, got {type_name(value)}")
    try:
        return ErrorCode(value), ""
    except ValueError:
        return ErrorCode.INTERNAL, f"[server error code {value!r}] "


def _model_info(value: object, index: int, limits: Limits) -> ModelInfo:
    what = f"welcome.models[{index}]"
    info = as_map(value, what)
    modes = get_list(info, "modes", what, max_len=_MAX_MODES)
    return ModelInfo(
        name=_id(info, "name", what, limits),
        num_quantizers=get_int(info, "num_quantizers", what, lo=1),
        codebook_size=get_int(info, "codebook_size", what, lo=0),  # 0: latents, no codebook
        samples_per_frame=get_int(info, "samples_per_frame", what, lo=1),
        sample_rate=get_int(info, "sample_rate", what, lo=1),
        modes=tuple(
            check_str(mode, f"{what}.modes[{i}]", max_nbytes=limits.max_id_len)
            for i, mode in enumerate(modes)
        ),
        dtype=_id(info, "dtype", what, limits),
        device=_id(info, "device", what, limits),
        **_contract(info, what, limits),
    )


def _contract(info: dict[str, Any], what: str, limits: Limits) -> dict[str, Any]:
    """The model entry's input contract fields; absent ones (an older server) keep ModelInfo's defaults."""
    out: dict[str, Any] = {}
    if "family" in info:
        out["family"] = check_str(info["family"], f"{what}.family", max_nbytes=limits.max_id_len, allow_empty=True)
    if "input_kind" in info:
        out["input_kind"] = check_str(info["input_kind"], f"{what}.input_kind", max_nbytes=limits.max_id_len)
    if "input_dtypes" in info:
        dtypes = get_list(info, "input_dtypes", what, max_len=_MAX_MODES)
        out["input_dtypes"] = tuple(check_str(d, f"{what}.input_dtypes[{i}]", max_nbytes=limits.max_id_len)
                                    for i, d in enumerate(dtypes))
    if "input_channels" in info:
        out["input_channels"] = get_int(info, "input_channels", what, lo=0)
    if info.get("input_range") is not None:
        bounds = get_list(info, "input_range", what, max_len=2)
        if len(bounds) != 2:
            invalid(f"{what}.input_range must be [low, high], got {len(bounds)} entries")
        low, high = (check_int(b, f"{what}.input_range[{i}]", lo=-INT64_MAX, hi=INT64_MAX)
                     for i, b in enumerate(bounds))
        out["input_range"] = (low, high)
    if "stream_options" in info:
        options = get_list(info, "stream_options", what, max_len=_MAX_MODES)
        out["stream_options"] = tuple(_stream_option(o, f"{what}.stream_options[{i}]", limits)
                                      for i, o in enumerate(options))
    return out


def _stream_option(value: object, what: str, limits: Limits) -> StreamOptionInfo:
    option = as_map(value, what)
    return StreamOptionInfo(
        name=check_str(require(option, "name", what), f"{what}.name", max_nbytes=limits.max_id_len),
        low=get_int(option, "low", what, lo=-INT64_MAX, hi=INT64_MAX),
        high=get_int(option, "high", what, lo=-INT64_MAX, hi=INT64_MAX),
        default=get_int(option, "default", what, lo=-INT64_MAX, hi=INT64_MAX),
    )


def parse_welcome(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Welcome:
    models = get_list(header, "models", "welcome", max_len=_MAX_MODELS)
    capabilities = as_map(header.get("capabilities", {}), "welcome.capabilities")
    return Welcome(
        request_id=_request_id(header, "welcome"),
        version=get_int(header, "version", "welcome", lo=0),
        server_id=_id(header, "server_id", "welcome", limits),
        boot_epoch=_id(header, "boot_epoch", "welcome", limits),
        models=tuple(_model_info(value, i, limits) for i, value in enumerate(models)),
        default_model=_id(header, "default_model", "welcome", limits),
        limits=Limits.from_wire(require(header, "limits", "welcome")),
        heartbeat_interval_s=get_positive_float(header, "heartbeat_interval_s", "welcome"),
        capabilities=dict(capabilities),
        session_secret=get_optional_str(header, "session_secret", "welcome", max_nbytes=limits.max_id_len,
                                        default=None),
    )


def parse_opened(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Opened:
    return Opened(
        request_id=_request_id(header, "opened"),
        stream_id=_id(header, "stream_id", "opened", limits),
        model=_id(header, "model", "opened", limits),
        mode=_id(header, "mode", "opened", limits),
        left_context_frames=get_int(header, "left_context_frames", "opened", lo=0),
        samples_per_frame=get_int(header, "samples_per_frame", "opened", lo=1),
        num_quantizers=get_int(header, "num_quantizers", "opened", lo=1),
    )


def _chunk_result(value: object, index: int, limits: Limits, frames: Sequence[Any]) -> ChunkResult:
    what = f"decode_result.results[{index}]"
    result = as_map(value, what)
    raw_audio = result.get("audio")
    raw_error = result.get("error")
    if (raw_audio is None) == (raw_error is None):
        invalid(f"{what} must carry exactly one of 'audio' and 'error'")
    audio: TensorDesc | None = None
    error: ErrorInfo | None = None
    if raw_audio is not None:
        try:
            audio = TensorDesc.from_wire(raw_audio, limits, len(frames))
            if audio.dtype != "float32" or len(audio.shape) != 1:
                invalid(f"audio must be float32 [num_samples], got {audio.dtype} {list(audio.shape)}")
            if isinstance(audio.loc, InlineLoc):
                inline_view(audio, frames)
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{what}.audio: {exc.message}") from None
    else:
        error_map = as_map(raw_error, f"{what}.error")
        code, prefix = _error_code(require(error_map, "code", f"{what}.error"))
        error = ErrorInfo(code=code, message=prefix + _text(error_map, "message", f"{what}.error", limits))
    audio_event = None
    if audio is not None and not isinstance(audio.loc, InlineLoc):
        audio_event = get_int(result, "audio_event", what, lo=0, hi=MAX_REGION_EVENTS - 1)
    return ChunkResult(
        stream_id=_id(result, "stream_id", what, limits),
        seq=get_int(result, "seq", what, lo=0, hi=INT64_MAX),
        audio=audio,
        num_frames=get_int(result, "num_frames", what, lo=0, default=0),
        error=error,
        audio_event=audio_event,
    )


def parse_decode_result(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> DecodeResult:
    request_id = _request_id(header, "decode_result")
    results = get_list(header, "results", "decode_result", max_len=limits.max_chunks_per_message)
    return DecodeResult(
        request_id=request_id,
        results=tuple(_chunk_result(value, i, limits, frames) for i, value in enumerate(results)),
    )


def parse_finished(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Finished:
    return Finished(request_id=_request_id(header, "finished"), stream_id=_id(header, "stream_id", "finished", limits))


def parse_aborted(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Aborted:
    return Aborted(request_id=_request_id(header, "aborted"), stream_id=_id(header, "stream_id", "aborted", limits))


def parse_pong(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Pong:
    return Pong(request_id=_request_id(header, "pong"), boot_epoch=_id(header, "boot_epoch", "pong", limits))


def parse_error(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Error:
    raw_request_id = require(header, "request_id", "error")
    request_id = None if raw_request_id is None else check_int(raw_request_id, "error.request_id", lo=0, hi=UINT64_MAX)
    code, prefix = _error_code(require(header, "code", "error"))
    return Error(request_id=request_id, code=code, message=prefix + _text(header, "message", "error", limits))
