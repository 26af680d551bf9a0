"""Encode and decode whole messages (sans-IO): frames in, dataclasses out, and back.

Rules: sans-IO; imports only the standard library and msgpack; never zmq,
torch or numpy; imports nothing outside ``proto``. Never pickle.

A message is a list of frames: frame 0 is a msgpack map (the header), frames
1.. are raw little-endian C-contiguous tensor bytes referenced by inline tensor
descriptors. ``encode`` passes buffers through untouched (zero-copy); the
decoders check sizes before parsing anything, parse the header with explicit
msgpack limits, and type-check every field. Any failure raises
``ProtocolError`` carrying the request id whenever it could be read, so a
server can scope its error reply.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import msgpack

from ._check import UINT64_MAX, as_map, invalid, is_int, type_name
from .errors import ProtocolError
from .limits import DEFAULT_LIMITS, Limits
from .messages import CLIENT_MESSAGES, SERVER_MESSAGES, ClientMessage, ServerMessage

__all__ = ["encode", "decode_client_message", "decode_server_message", "decode_message", "read_header", "Buffer",
           "parsers"]

Buffer = Union[bytes, bytearray, memoryview]
Parser = Callable[[dict[str, Any], Limits, Sequence[Any]], Any]

_MAX_MAP_LEN = 256


def parsers(classes: Sequence[type]) -> dict[str, Parser]:
    """``{TYPE: parse}`` of declared message classes: what a decoder dispatches on."""
    return {cls.TYPE: cls.WIRE.parse_message for cls in classes}  # type: ignore[attr-defined]


_CLIENT_PARSERS = parsers(CLIENT_MESSAGES)
_SERVER_PARSERS = parsers(SERVER_MESSAGES)


def encode(msg: ClientMessage | ServerMessage, buffers: Sequence[Buffer] = ()) -> list[Buffer]:
    """Return ``[msgpack header, *buffers]``; buffers are passed through without copies.

    Inline tensor descriptors in ``msg`` must name the buffers' frame indices
    (the first buffer is frame 1).
    """
    to_wire = getattr(msg, "to_wire", None)
    if to_wire is None or not hasattr(msg, "TYPE"):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    header: bytes = msgpack.packb(to_wire(), use_bin_type=True)
    return [header, *buffers]


def _reject_ext(code: int, data: bytes) -> object:
    invalid(f"msgpack extension types are not allowed (got ext type {code})")


def _check_frame_count(frames: Sequence[Any], limits: Limits) -> None:
    if len(frames) > limits.max_frames_per_message:
        invalid(f"message has {len(frames)} frames; the limit is {limits.max_frames_per_message} "
                "(max_frames_per_message)")


def _check_message_nbytes(frames: Sequence[Any], limits: Limits) -> None:
    total_nbytes = 0
    for frame in frames:
        try:
            total_nbytes += memoryview(frame).nbytes
        except TypeError:
            invalid(f"frame of type {type_name(frame)} is not a bytes-like object")
    if total_nbytes > limits.max_message_bytes:
        invalid(f"message is {total_nbytes} bytes; the limit is {limits.max_message_bytes} (max_message_bytes)")


def read_header(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS, check_size: bool = True
                ) -> dict[str, Any]:
    """Check the message's size limits and unpack frame 0 (at most ``max_header_bytes``) into a header map.
    The decoders check the message's size after reading its request id (``check_size=False``), so that
    error is scoped to the request; and its frame count after parsing, so a decode with too many chunks (and
    so too many frames) is answered naming ``max_chunks_per_message``."""
    if len(frames) == 0:
        invalid("empty message: expected a msgpack header frame")
    if check_size:
        _check_frame_count(frames, limits)
        _check_message_nbytes(frames, limits)
    try:
        header_nbytes = memoryview(frames[0]).nbytes
    except TypeError:
        invalid(f"frame of type {type_name(frames[0])} is not a bytes-like object")
    if header_nbytes > limits.max_header_bytes:
        invalid(f"header is {header_nbytes} bytes; the limit is {limits.max_header_bytes} (max_header_bytes)")
    try:
        header = msgpack.unpackb(
            frames[0],
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limits.max_header_bytes,
            max_bin_len=0,
            max_array_len=header_nbytes,  # (an entry takes >= 1 byte) the parsers check the protocol's limits
            # by their wire names (e.g. max_chunks_per_message), with the request id
            max_map_len=_MAX_MAP_LEN,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types; all mean "bad header"
        invalid(f"header is not a valid msgpack document ({type(exc).__name__}: {exc})")
    return as_map(header, "header")


def _peek_request_id(header: dict[str, Any]) -> int | None:
    value = header.get("request_id")
    if is_int(value) and 0 <= value <= UINT64_MAX:
        return int(value)
    return None


def _message_type(header: dict[str, Any], known: dict[str, Parser]) -> str:
    msg_type = header.get("type")
    if not isinstance(msg_type, str):
        invalid(f"header key 'type' must be a string, got {type_name(msg_type)}")
    if msg_type not in known:
        invalid(f"unknown message type {msg_type!r} (known: {', '.join(known)})")
    return msg_type


def decode_message(frames: Sequence[Any], table: dict[str, Parser], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Parse and validate a message of one of the types in ``table`` (``parsers``)."""
    header = read_header(frames, limits, check_size=False)
    request_id = _peek_request_id(header)
    try:
        _check_message_nbytes(frames, limits)
        parser = table[_message_type(header, table)]
        msg = parser(header, limits, frames)
        _check_frame_count(frames, limits)
        return msg
    except ProtocolError as exc:
        raise exc.with_request_id(request_id) from None


def decode_client_message(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> ClientMessage:
    """Parse and validate a client -> server message (strict: unknown keys are rejected)."""
    return decode_message(frames, _CLIENT_PARSERS, limits)


def decode_server_message(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> ServerMessage:
    """Parse and validate a server -> client message (unknown keys are ignored)."""
    return decode_message(frames, _SERVER_PARSERS, limits)
