"""Parsers for client -> server headers (private to ``proto``; used by ``codec``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. Strict: unknown
keys are rejected with INVALID_ARGUMENT naming the key, except inside
``hello.capabilities`` where unknown capabilities are ignored (forward
compatibility). A ``hello`` with another protocol version raises
VERSION_MISMATCH before anything else is checked.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._check import (
    UINT64_MAX,
    INT64_MAX,
    as_map,
    get_bool,
    get_choice,
    get_int,
    get_list,
    get_optional_str,
    get_str,
    invalid,
    is_int,
    reject_unknown_keys,
    type_name,
)
from .errors import ErrorCode, ProtocolError
from .limits import Limits
from .messages import (
    PROTOCOL_VERSION,
    STREAM_MODES,
    Abort,
    Bye,
    Chunk,
    Decode,
    Finish,
    Hello,
    OpenStream,
    Ping,
)
from .ipc import MAX_REGION_EVENTS
from .tensors import CudaIpcLoc, InlineLoc, TensorDesc, inline_view

_HELLO_KEYS = frozenset({"type", "request_id", "version", "client_id", "capabilities", "session_secret"})
_OPEN_KEYS = frozenset({"type", "request_id", "stream_id", "model", "mode", "left_context_frames", "options"})
_MAX_STREAM_OPTIONS = 16
_DECODE_KEYS = frozenset({"type", "request_id", "chunks"})
_CHUNK_KEYS = frozenset({"stream_id", "seq", "codes", "final", "context_frames", "codes_event", "audio_out"})
_STREAM_OP_KEYS = frozenset({"type", "request_id", "stream_id"})
_BARE_KEYS = frozenset({"type", "request_id"})


def request_id_of(header: dict[str, Any], what: str) -> int:
    return get_int(header, "request_id", what, lo=0, hi=UINT64_MAX)


def parse_hello(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Hello:
    version = header.get("version")
    if not is_int(version):
        invalid(f"hello.version must be an integer, got {type_name(version)}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"this server speaks protocol version {PROTOCOL_VERSION}; hello carried version {version}",
        )
    reject_unknown_keys(header, _HELLO_KEYS, "hello")
    capabilities = as_map(header.get("capabilities", {}), "hello.capabilities")
    known: dict[str, Any] = {}
    if "cuda_ipc" in capabilities:
        known["cuda_ipc"] = get_bool(capabilities, "cuda_ipc", "hello.capabilities")
    for key in ("gpu_uuid", "host_id"):
        if key in capabilities:
            known[key] = get_optional_str(capabilities, key, "hello.capabilities", max_nbytes=limits.max_id_len)
    return Hello(
        request_id=request_id_of(header, "hello"),
        version=PROTOCOL_VERSION,
        client_id=get_str(header, "client_id", "hello", max_nbytes=limits.max_id_len),
        capabilities=known,
        session_secret=get_optional_str(header, "session_secret", "hello", max_nbytes=limits.max_id_len,
                                        default=None),
    )


def parse_open_stream(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> OpenStream:
    reject_unknown_keys(header, _OPEN_KEYS, "open_stream")
    return OpenStream(
        request_id=request_id_of(header, "open_stream"),
        stream_id=get_str(header, "stream_id", "open_stream", max_nbytes=limits.max_id_len),
        model=get_optional_str(header, "model", "open_stream", max_nbytes=limits.max_id_len, default=None),
        mode=get_choice(header, "mode", "open_stream", choices=STREAM_MODES, default="exact"),
        left_context_frames=get_int(
            header, "left_context_frames", "open_stream", lo=0, hi=limits.max_left_context_frames, default=0
        ),
        options=_stream_options(header, limits),
    )


def _stream_options(header: dict[str, Any], limits: Limits) -> dict[str, int]:
    """``open_stream.options``: a map of option name -> integer (which names and ranges: the server's model)."""
    if header.get("options") is None:
        return {}
    options = as_map(header["options"], "open_stream.options")
    if len(options) > _MAX_STREAM_OPTIONS:
        invalid(f"open_stream.options has {len(options)} entries; the limit is {_MAX_STREAM_OPTIONS}")
    for name in options:
        if len(name.encode("utf-8", "surrogatepass")) > limits.max_id_len:
            invalid(f"open_stream.options has a name longer than {limits.max_id_len} bytes")
        get_int(options, name, "open_stream.options", lo=-INT64_MAX, hi=INT64_MAX)
    return dict(options)


def _parse_chunk(value: object, index: int, limits: Limits, frames: Sequence[Any]) -> Chunk:
    what = f"decode.chunks[{index}]"
    chunk = as_map(value, what)
    reject_unknown_keys(chunk, _CHUNK_KEYS, what)
    stream_id = get_str(chunk, "stream_id", what, max_nbytes=limits.max_id_len)
    seq = get_int(chunk, "seq", what, lo=0, hi=INT64_MAX)
    final = get_bool(chunk, "final", what, default=False)
    if "codes" not in chunk:
        invalid(f"{what} is missing required key 'codes'")
    try:
        codes = TensorDesc.from_wire(chunk["codes"], limits, len(frames))
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{what}.codes: {exc.message}") from None
    # Any wire dtype: the model's contract (welcome: ``input_dtypes``) decides, per chunk, naming its shape.
    if len(codes.shape) != 2:
        invalid(f"{what}.codes must have rank 2 [num_quantizers, num_frames], got shape {list(codes.shape)}")
    num_quantizers, num_frames = codes.shape
    if num_quantizers < 1:
        invalid(f"{what}.codes has 0 quantizers")
    if num_frames > limits.max_chunk_frames:
        invalid(f"{what}.codes has {num_frames} frames; the limit is {limits.max_chunk_frames} (max_chunk_frames)")
    if num_frames == 0 and not final:
        invalid(f"{what}.codes has 0 frames; only a final chunk may be empty")
    context_frames = get_int(chunk, "context_frames", what, lo=0, default=0)
    if context_frames > num_frames:
        invalid(f"{what}.context_frames is {context_frames} but the chunk has only {num_frames} frames")
    if isinstance(codes.loc, InlineLoc):
        try:
            inline_view(codes, frames)
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{what}.codes: {exc.message}") from None
        if chunk.get("codes_event") is not None:
            invalid(f"{what}.codes_event is only allowed with cuda_ipc codes")
        codes_event = None
    else:
        codes_event = get_int(chunk, "codes_event", what, lo=0, hi=MAX_REGION_EVENTS - 1)
    audio_out = None
    if chunk.get("audio_out") is not None:
        try:
            audio_out = TensorDesc.from_wire(chunk["audio_out"], limits, len(frames))
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{what}.audio_out: {exc.message}") from None
        if not isinstance(audio_out.loc, CudaIpcLoc):
            invalid(f"{what}.audio_out must be a cuda_ipc descriptor (inline audio needs no audio_out)")
        if audio_out.dtype != "float32" or len(audio_out.shape) != 1:
            invalid(f"{what}.audio_out must be float32 [num_samples], got {audio_out.dtype} {list(audio_out.shape)}")
    return Chunk(stream_id=stream_id, seq=seq, codes=codes, final=final, context_frames=context_frames,
                 codes_event=codes_event, audio_out=audio_out)


def parse_decode(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Decode:
    reject_unknown_keys(header, _DECODE_KEYS, "decode")
    request_id = request_id_of(header, "decode")
    raw_chunks = get_list(header, "chunks", "decode", max_len=limits.max_chunks_per_message,
                          limit_name="max_chunks_per_message")
    if not raw_chunks:
        invalid("decode.chunks must hold at least one chunk")
    chunks = tuple(_parse_chunk(value, index, limits, frames) for index, value in enumerate(raw_chunks))
    return Decode(request_id=request_id, chunks=chunks)


def _stream_id(header: dict[str, Any], what: str, limits: Limits) -> str:
    reject_unknown_keys(header, _STREAM_OP_KEYS, what)
    return get_str(header, "stream_id", what, max_nbytes=limits.max_id_len)


def parse_finish(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Finish:
    stream_id = _stream_id(header, "finish", limits)
    return Finish(request_id=request_id_of(header, "finish"), stream_id=stream_id)


def parse_abort(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Abort:
    stream_id = _stream_id(header, "abort", limits)
    return Abort(request_id=request_id_of(header, "abort"), stream_id=stream_id)


def parse_ping(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Ping:
    reject_unknown_keys(header, _BARE_KEYS, "ping")
    return Ping(request_id=request_id_of(header, "ping"))


def parse_bye(header: dict[str, Any], limits: Limits, frames: Sequence[Any]) -> Bye:
    reject_unknown_keys(header, _BARE_KEYS, "bye")
    return Bye(request_id=request_id_of(header, "bye"))
