"""Fuzzing the decoders: whatever arrives, they return a message or raise ProtocolError."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from code2wav.proto import (
    ErrorCode,
    Limits,
    ProtocolError,
    decode_client_message,
    decode_server_message,
    encode,
)
from code2wav.proto.messages import Chunk, Decode, OpenStream
from code2wav.proto.tensors import InlineLoc, TensorDesc

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = Limits(max_message_bytes=1 << 16, max_header_bytes=4096)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
KEYS = ["type", "request_id", "version", "client_id", "capabilities", "stream_id", "model", "mode",
        "left_context_frames", "chunks", "seq", "codes", "final", "context_frames", "dtype", "shape",
        "loc", "frame", "region", "offset", "nbytes"]
TYPES = ["hello", "open_stream", "decode", "finish", "abort", "ping", "bye", "welcome", "decode_result"]
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
values = st.recursive(
    st.one_of(scalars, st.sampled_from(TYPES + ["inline", "cuda_ipc", "int64", "exact", "window"])),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(keys, children, max_size=6),
    ),
    max_leaves=25,
)
headers = st.dictionaries(keys, values, max_size=8).map(lambda d: {"type": "decode", **d})
extra_frames = st.lists(st.binary(max_size=64), max_size=3)


def check(decoder: Any, frames: list[Any]) -> None:
    try:
        result = decoder(frames, LIMITS)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert exc.message
        assert exc.request_id is None or 0 <= exc.request_id < 2**64
    else:
        assert hasattr(result, "request_id") and hasattr(result, "TYPE")


@SETTINGS
@given(st.binary(max_size=512), extra_frames)
def test_random_bytes_only_raise_protocol_error(header: bytes, frames: list[bytes]) -> None:
    check(decode_client_message, [header, *frames])
    check(decode_server_message, [header, *frames])


@SETTINGS
@given(values, extra_frames)
def test_random_msgpack_objects_only_raise_protocol_error(obj: Any, frames: list[bytes]) -> None:
    check(decode_client_message, [msgpack.packb(obj, use_bin_type=True), *frames])


@SETTINGS
@given(headers, extra_frames)
def test_random_headers_only_raise_protocol_error(header: dict[str, Any], frames: list[bytes]) -> None:
    packed = msgpack.packb(header, use_bin_type=True)
    check(decode_client_message, [packed, *frames])
    check(decode_server_message, [packed, *frames])


@SETTINGS
@given(
    st.integers(min_value=0, max_value=300),
    st.integers(min_value=0, max_value=255),
)
def test_mutated_valid_decode_only_raises_protocol_error(position: int, byte: int) -> None:
    desc = TensorDesc("int32", (2, 3), InlineLoc(1))
    frames = encode(Decode(5, (Chunk("stream", 4, desc, final=True, context_frames=1),)), [bytes(24)])
    header = bytearray(frames[0])
    header[position % len(header)] = byte
    check(decode_client_message, [bytes(header), frames[1]])


@SETTINGS
@given(st.text(min_size=1, max_size=40), st.integers(min_value=0, max_value=2**64 - 1))
def test_valid_open_streams_round_trip(stream_id: str, request_id: int) -> None:
    msg = OpenStream(request_id, stream_id, None, "window", 25)
    try:
        assert decode_client_message(encode(msg), LIMITS) == msg
    except ProtocolError as exc:  # only the id-length limit may refuse it
        assert len(stream_id.encode("utf-8", "surrogatepass")) > LIMITS.max_id_len, exc
