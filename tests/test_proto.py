"""Wire protocol v1: round trips of every message and every validation rule."""

from __future__ import annotations

import ast
import pathlib
import struct
from typing import Any

import msgpack
import pytest

from code2wav import proto
from code2wav.proto import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    WIRE_DTYPE_ITEMSIZES,
    Abort,
    Aborted,
    Bye,
    Chunk,
    ChunkResult,
    CudaIpcLoc,
    Decode,
    DecodeResult,
    Error,
    ErrorCode,
    ErrorInfo,
    Finish,
    Finished,
    Hello,
    InlineLoc,
    Limits,
    ModelInfo,
    Opened,
    OpenStream,
    Ping,
    Pong,
    ProtocolError,
    TensorDesc,
    Welcome,
    decode_client_message,
    decode_server_message,
    encode,
    inline_view,
)

PROTO_DIR = pathlib.Path(proto.__file__).parent


def codes_frame(num_quantizers: int, num_frames: int, itemsize: int = 8) -> bytes:
    return b"\x01" * (num_quantizers * num_frames * itemsize)


def decode_msg(request_id: int = 7, q: int = 16, n: int = 25, **chunk: Any) -> tuple[Decode, list[Any]]:
    desc = TensorDesc("int64", (q, n), InlineLoc(1))
    msg = Decode(request_id, (Chunk(chunk.pop("stream_id", "s1"), chunk.pop("seq", 0), desc, **chunk),))
    return msg, encode(msg, [codes_frame(q, n)])


def header_frames(header: dict[str, Any], *buffers: bytes) -> list[bytes]:
    return [msgpack.packb(header), *buffers]


def expect_error(frames: list[Any], code: ErrorCode, fragment: str, *, server: bool = False,
                 limits: Limits = DEFAULT_LIMITS) -> ProtocolError:
    decoder = decode_server_message if server else decode_client_message
    with pytest.raises(ProtocolError) as info:
        decoder(frames, limits)
    assert info.value.code is code, info.value
    assert fragment in info.value.message, info.value.message
    return info.value


# ----------------------------------------------------------------------------- import rules


def test_proto_imports_only_stdlib_and_msgpack() -> None:
    allowed_roots = {"__future__", "dataclasses", "enum", "math", "typing", "msgpack"}
    for path in PROTO_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree) and "Rules" in ast.get_docstring(tree), path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    continue  # relative import inside proto
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed_roots, f"{path.name} imports {roots - allowed_roots}"


# ----------------------------------------------------------------------------- round trips


def test_hello_round_trip() -> None:
    msg = Hello(2**64 - 1, PROTOCOL_VERSION, "runner-1", {"cuda_ipc": True, "gpu_uuid": "GPU-abc"})
    frames = encode(msg)
    assert len(frames) == 1
    assert decode_client_message(frames) == msg


def test_hello_ignores_unknown_capabilities() -> None:
    frames = encode(Hello(1, 1, "c", {"cuda_ipc": False, "gpu_uuid": None, "future_thing": [1, 2]}))
    decoded = decode_client_message(frames)
    assert isinstance(decoded, Hello)
    assert decoded.capabilities == {"cuda_ipc": False, "gpu_uuid": None}


def test_open_stream_round_trip_and_defaults() -> None:
    msg = OpenStream(3, "req-1", "qwen3-tts-12hz", "window", 25)
    assert decode_client_message(encode(msg)) == msg
    minimal = decode_client_message(header_frames({"type": "open_stream", "request_id": 4, "stream_id": "x"}))
    assert minimal == OpenStream(4, "x", None, "exact", 0)


def test_decode_round_trip_many_chunks_and_inline_view() -> None:
    descs = [TensorDesc("int32", (16, n), InlineLoc(i + 1)) for i, n in enumerate((25, 0, 3))]
    chunks = (
        Chunk("a", 0, descs[0], final=False, context_frames=5),
        Chunk("b", 9, descs[1], final=True, context_frames=0),
        Chunk("a", 1, descs[2]),
    )
    buffers = [struct.pack(f"<{16 * n}i", *range(16 * n)) for n in (25, 0, 3)]
    frames = encode(Decode(11, chunks), buffers)
    assert frames[1:] == buffers  # passed through untouched
    assert all(a is b for a, b in zip(frames[1:], buffers))  # same objects: zero-copy
    decoded = decode_client_message(frames)
    assert decoded == Decode(11, chunks)
    assert isinstance(decoded, Decode)
    assert decoded.chunks[0].num_frames == 25
    view = inline_view(decoded.chunks[2].codes, frames)
    assert view.nbytes == 16 * 3 * 4
    assert struct.unpack("<48i", view) == tuple(range(48))


def test_cuda_ipc_descriptor_round_trip() -> None:
    desc = TensorDesc("int64", (16, 25), CudaIpcLoc(region_id=7, offset=4096, nbytes=3200))
    assert desc.to_wire() == {
        "dtype": "int64", "shape": [16, 25], "loc": "cuda_ipc", "region": 7, "offset": 4096, "nbytes": 3200,
    }
    msg = Decode(1, (Chunk("s", 0, desc, codes_event=3),))
    assert decode_client_message(encode(msg)) == msg


def test_inline_descriptor_wire_form() -> None:
    desc = TensorDesc("int64", (16, 25), InlineLoc(1))
    assert desc.to_wire() == {"dtype": "int64", "shape": [16, 25], "loc": "inline", "frame": 1}
    assert (desc.numel, desc.nbytes, desc.itemsize) == (400, 3200, 8)


@pytest.mark.parametrize("msg", [Finish(5, "s"), Abort(6, "s"), Ping(0), Bye(2**63)])
def test_small_client_messages_round_trip(msg: Any) -> None:
    assert decode_client_message(encode(msg)) == msg


def welcome() -> Welcome:
    model = ModelInfo("qwen3-tts-12hz", 16, 2048, 1920, 24000, ("exact", "window"), "bfloat16", "cuda:0")
    return Welcome(
        request_id=1, version=1, server_id="sidecar-a", boot_epoch="e-123", models=(model,),
        default_model="qwen3-tts-12hz", limits=Limits(max_chunk_frames=512), heartbeat_interval_s=0.25,
        capabilities={"cuda_ipc": False},
    )


def test_server_messages_round_trip() -> None:
    audio = TensorDesc("float32", (4 * 1920,), InlineLoc(1))
    result = DecodeResult(
        9,
        (
            ChunkResult("a", 3, audio, 4),
            ChunkResult("b", 0, None, 0, ErrorInfo(ErrorCode.OUT_OF_ORDER, "expected seq 1")),
        ),
    )
    assert decode_server_message(encode(result, [bytes(4 * 1920 * 4)])) == result
    for msg in (
        welcome(),
        Opened(2, "a", "qwen3-tts-12hz", "window", 25, 1920, 16),
        Finished(3, "a"),
        Aborted(4, "a"),
        Pong(5, "e-123"),
        Error(6, ErrorCode.BUSY, "too many streams"),
        Error(None, ErrorCode.INVALID_ARGUMENT, "header is not a valid msgpack document"),
    ):
        assert decode_server_message(encode(msg)) == msg
    info = welcome()
    assert info.model(None) is info.models[0]
    assert info.model("qwen3-tts-12hz") is info.models[0]
    assert info.model("other") is None


def test_server_decoder_is_lenient_about_unknown_keys_and_codes() -> None:
    wire = Pong(5, "e").to_wire() | {"new_field": 1}
    assert decode_server_message(header_frames(wire)) == Pong(5, "e")
    err = decode_server_message(header_frames({"type": "error", "request_id": 1, "code": "quota", "message": "m"}))
    assert isinstance(err, Error)
    assert err.code is ErrorCode.INTERNAL
    assert err.message == "[server error code 'quota'] m"


def test_limits_wire_round_trip() -> None:
    limits = Limits(max_chunk_frames=100, max_left_context_frames=0)
    assert Limits.from_wire(limits.to_wire()) == limits
    assert Limits.from_wire({"max_rank": 3, "unknown": 5}) == Limits(max_rank=3)
    with pytest.raises(ProtocolError, match="limits.max_rank"):
        Limits.from_wire({"max_rank": True})


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        encode({"type": "ping"})  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- framing limits


def test_empty_message() -> None:
    expect_error([], ErrorCode.INVALID_ARGUMENT, "empty message")


def test_oversized_header() -> None:
    limits = Limits(max_header_bytes=64)
    frames = encode(Hello(1, 1, "x" * 100))
    error = expect_error(frames, ErrorCode.INVALID_ARGUMENT, "header is", limits=limits)
    assert "limit is 64" in error.message
    assert error.request_id is None  # nothing was parsed


def test_oversized_message_and_too_many_frames() -> None:
    msg, frames = decode_msg()
    expect_error(frames, ErrorCode.INVALID_ARGUMENT, "bytes; the limit is 1000", limits=Limits(max_message_bytes=1000))
    expect_error(frames + [b""], ErrorCode.INVALID_ARGUMENT, "3 frames; the limit is 2",
                 limits=Limits(max_frames_per_message=2))


def test_truncated_msgpack() -> None:
    frames = encode(OpenStream(1, "abc"))
    error = expect_error([frames[0][:-3]], ErrorCode.INVALID_ARGUMENT, "not a valid msgpack")
    assert error.request_id is None


def test_trailing_bytes_and_ext_types_rejected() -> None:
    expect_error([encode(Ping(1))[0] + b"\x00"], ErrorCode.INVALID_ARGUMENT, "not a valid msgpack")
    ext = msgpack.packb({"type": "ping", "request_id": msgpack.ExtType(5, b"xy")})
    expect_error([ext], ErrorCode.INVALID_ARGUMENT, "not a valid msgpack")
    stamp = msgpack.packb({"type": "ping", "request_id": msgpack.Timestamp(1, 0)})
    expect_error([stamp], ErrorCode.INVALID_ARGUMENT, "not a valid msgpack")


def test_header_must_be_map_with_string_keys_and_known_type() -> None:
    expect_error([msgpack.packb([1, 2])], ErrorCode.INVALID_ARGUMENT, "header must be a map, got list")
    expect_error([msgpack.packb({1: 2})], ErrorCode.INVALID_ARGUMENT, "not a valid msgpack")  # strict_map_key
    error = expect_error(header_frames({"type": "teleport", "request_id": 3}), ErrorCode.INVALID_ARGUMENT,
                         "unknown message type 'teleport'")
    assert error.request_id == 3  # scoped: the id was readable
    expect_error(header_frames({"request_id": 3}), ErrorCode.INVALID_ARGUMENT, "'type' must be a string")
    # a server message sent to the server is unknown there
    expect_error(encode(Pong(1, "e")), ErrorCode.INVALID_ARGUMENT, "unknown message type 'pong'")


def test_bin_strings_rejected() -> None:
    frames = [msgpack.packb({"type": "finish", "request_id": 1, "stream_id": b"abc"}, use_bin_type=True)]
    expect_error(frames, ErrorCode.INVALID_ARGUMENT, "not a valid msgpack")


# ----------------------------------------------------------------------------- field rules


def test_wrong_version_is_version_mismatch() -> None:
    error = expect_error(encode(Hello(12, 2, "c")), ErrorCode.VERSION_MISMATCH, "hello carried version 2")
    assert error.request_id == 12
    # checked before unknown keys, so a newer client learns the real problem
    wire = Hello(13, 99, "c").to_wire() | {"new_in_v99": True}
    assert expect_error(header_frames(wire), ErrorCode.VERSION_MISMATCH, "version 99").request_id == 13


def test_bool_is_not_an_int() -> None:
    wire = OpenStream(1, "s", mode="window", left_context_frames=3).to_wire()
    wire["left_context_frames"] = True
    expect_error(header_frames(wire), ErrorCode.INVALID_ARGUMENT, "left_context_frames must be an integer, got bool")
    expect_error(header_frames({"type": "ping", "request_id": True}), ErrorCode.INVALID_ARGUMENT,
                 "request_id must be an integer, got bool")
    expect_error(header_frames(Hello(1, 1, "c").to_wire() | {"version": True}), ErrorCode.INVALID_ARGUMENT,
                 "hello.version must be an integer, got bool")
    msg, frames = decode_msg()
    wire = msg.to_wire()
    wire["chunks"][0]["codes"]["shape"] = [True, 25]
    expect_error(header_frames(wire, frames[1]), ErrorCode.INVALID_ARGUMENT, "shape[0] must be an integer, got bool")


def test_unknown_keys_rejected_naming_the_key() -> None:
    for msg in (OpenStream(1, "s"), Finish(1, "s"), Abort(1, "s"), Ping(1), Bye(1), Hello(1, 1, "c")):
        wire = msg.to_wire() | {"colour": "blue"}
        error = expect_error(header_frames(wire), ErrorCode.INVALID_ARGUMENT, "unknown key 'colour'")
        assert error.request_id == 1
    msg, frames = decode_msg()
    wire = msg.to_wire()
    wire["chunks"][0]["priority"] = 1
    expect_error(header_frames(wire, frames[1]), ErrorCode.INVALID_ARGUMENT, "chunks[0] has unknown key 'priority'")
    wire = msg.to_wire()
    wire["chunks"][0]["codes"]["strides"] = [25, 1]
    expect_error(header_frames(wire, frames[1]), ErrorCode.INVALID_ARGUMENT, "unknown key 'strides'")


def test_wrong_types_and_missing_keys() -> None:
    expect_error(header_frames({"type": "finish", "request_id": 1, "stream_id": 5}), ErrorCode.INVALID_ARGUMENT,
                 "finish.stream_id must be a string, got int")
    expect_error(header_frames({"type": "finish", "request_id": 1}), ErrorCode.INVALID_ARGUMENT,
                 "missing required key 'stream_id'")
    expect_error(header_frames({"type": "finish", "request_id": 1, "stream_id": ""}), ErrorCode.INVALID_ARGUMENT,
                 "must not be empty")
    expect_error(header_frames({"type": "ping", "request_id": -1}), ErrorCode.INVALID_ARGUMENT,
                 "request_id must be in [0, 18446744073709551615], got -1")
    expect_error(header_frames({"type": "ping"}), ErrorCode.INVALID_ARGUMENT, "missing required key 'request_id'")
    expect_error(header_frames({"type": "open_stream", "request_id": 1, "stream_id": "s", "mode": "fast"}),
                 ErrorCode.INVALID_ARGUMENT, "mode must be one of 'exact', 'window'; got 'fast'")
    expect_error(header_frames({"type": "open_stream", "request_id": 1, "stream_id": "s", "left_context_frames": 1025}),
                 ErrorCode.INVALID_ARGUMENT, "left_context_frames must be in [0, 1024], got 1025")
    expect_error(header_frames({"type": "decode", "request_id": 1, "chunks": {}}), ErrorCode.INVALID_ARGUMENT,
                 "chunks must be an array, got dict")
    expect_error(header_frames({"type": "decode", "request_id": 1, "chunks": []}), ErrorCode.INVALID_ARGUMENT,
                 "at least one chunk")
    expect_error(header_frames({"type": "hello", "request_id": 1, "version": 1, "client_id": "c",
                                "capabilities": {"cuda_ipc": "yes"}}),
                 ErrorCode.INVALID_ARGUMENT, "cuda_ipc must be a boolean, got str")


def test_id_length_limit_counts_utf8_bytes() -> None:
    limits = Limits(max_id_len=4)
    assert decode_client_message(encode(Finish(1, "abcd")), limits) == Finish(1, "abcd")
    expect_error(encode(Finish(1, "abcde")), ErrorCode.INVALID_ARGUMENT, "5 bytes long; the limit is 4", limits=limits)
    expect_error(encode(Finish(1, "éé€")), ErrorCode.INVALID_ARGUMENT, "7 bytes long", limits=limits)


def test_too_many_chunks() -> None:
    desc = TensorDesc("int64", (1, 1), CudaIpcLoc(0, 0, 8))
    msg = Decode(1, tuple(Chunk("s", i, desc) for i in range(3)))
    expect_error(encode(msg), ErrorCode.INVALID_ARGUMENT, "3 entries; the limit is 2",
                 limits=Limits(max_chunks_per_message=2))


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda c: c["codes"].update(shape=[16, -1]), "shape[1] must be in [0,"),
        (lambda c: c["codes"].update(shape=[16, 25, 1]), "rank 2 [num_quantizers, num_frames]"),
        (lambda c: c["codes"].update(shape=[1, 1, 1, 1, 1]), "rank 5 exceeds the limit of 4"),
        (lambda c: c["codes"].update(shape=[2**40, 2**40]), "elements; the limit is 67108864"),
        (lambda c: c["codes"].update(shape="16x25"), "shape must be an array of integers, got str"),
        (lambda c: c["codes"].update(dtype="float16"), "holds 3200 bytes but dtype float16"),  # the model decides
        (lambda c: c["codes"].update(dtype="uint8"), "dtype must be one of"),
        (lambda c: c["codes"].update(frame=2), "tensor frame must be in [1, 1], got 2"),
        (lambda c: c["codes"].update(frame=0), "tensor frame must be in [1, 1], got 0"),
        (lambda c: c["codes"].pop("frame"), "missing required key 'frame'"),
        (lambda c: c["codes"].update(loc="shm"), "loc must be 'inline' or 'cuda_ipc'"),
        (lambda c: c["codes"].update(shape=[16, 24]), "holds 3200 bytes but dtype int64 and shape [16, 24] need 3072"),
        (lambda c: c["codes"].update(shape=[0, 25]), "0 quantizers"),
        (lambda c: c["codes"].update(shape=[16, 0]), "only a final chunk may be empty"),
        (lambda c: c.update(context_frames=26), "context_frames is 26 but the chunk has only 25 frames"),
        (lambda c: c.update(context_frames=-1), "context_frames must be in [0,"),
        (lambda c: c.update(seq=1.0), "seq must be an integer, got float"),
        (lambda c: c.update(final=1), "final must be a boolean, got int"),
        (lambda c: c.pop("codes"), "missing required key 'codes'"),
    ],
)
def test_chunk_validation(mutate: Any, fragment: str) -> None:
    msg, frames = decode_msg(request_id=77)
    wire = msg.to_wire()
    mutate(wire["chunks"][0])
    error = expect_error(header_frames(wire, frames[1]), ErrorCode.INVALID_ARGUMENT, fragment)
    assert error.request_id == 77
    assert "decode.chunks[0]" in error.message


def test_chunk_frame_limit() -> None:
    limits = Limits(max_chunk_frames=24)
    msg, frames = decode_msg(n=25)
    expect_error(frames, ErrorCode.INVALID_ARGUMENT, "has 25 frames; the limit is 24", limits=limits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int16"])
def test_chunk_inputs_may_have_any_wire_dtype(dtype: str) -> None:
    """The protocol carries every wire dtype; the model's contract (welcome ``input_dtypes``) decides per chunk."""
    desc = TensorDesc(dtype, (16, 5), InlineLoc(1))
    frames = encode(Decode(1, (Chunk("s", 0, desc),)), [bytes(desc.nbytes)])
    decoded = decode_client_message(frames)
    assert isinstance(decoded, Decode) and decoded.chunks[0].codes == desc
    assert len(inline_view(desc, frames)) == 16 * 5 * WIRE_DTYPE_ITEMSIZES[dtype]


def test_empty_final_chunk_is_allowed() -> None:
    msg, frames = decode_msg(n=0, final=True)
    decoded = decode_client_message(frames)
    assert isinstance(decoded, Decode) and decoded.chunks[0].num_frames == 0 and decoded.chunks[0].final


def test_cuda_ipc_nbytes_must_match() -> None:
    desc = TensorDesc("int64", (16, 25), CudaIpcLoc(7, 0, 800))
    error = expect_error(encode(Decode(1, (Chunk("s", 0, desc),))), ErrorCode.INVALID_ARGUMENT,
                         "nbytes is 800 but dtype int64 and shape [16, 25] need 3200")
    assert error.request_id == 1
    wire = Decode(1, (Chunk("s", 0, TensorDesc("int64", (1, 1), CudaIpcLoc(7, -1, 8))),)).to_wire()
    expect_error(header_frames(wire), ErrorCode.INVALID_ARGUMENT, "tensor offset must be in [0,")


def test_inline_view_checks_length_exactly() -> None:
    desc = TensorDesc("float32", (10,), InlineLoc(1))
    assert inline_view(desc, [b"h", bytes(40)]).nbytes == 40
    with pytest.raises(ProtocolError) as info:
        inline_view(desc, [b"h", bytes(41)])
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert "holds 41 bytes" in info.value.message and "need 40 bytes" in info.value.message
    with pytest.raises(ProtocolError, match="out of range"):
        inline_view(TensorDesc("float32", (10,), InlineLoc(2)), [b"h", bytes(40)])
    with pytest.raises(ProtocolError, match="not inline"):
        inline_view(TensorDesc("float32", (10,), CudaIpcLoc(1, 0, 40)), [b"h"])


def test_from_wire_validates_directly() -> None:
    limits = DEFAULT_LIMITS
    assert TensorDesc.from_wire({"dtype": "bfloat16", "shape": [], "loc": "inline", "frame": 1}, limits, 2) == \
        TensorDesc("bfloat16", (), InlineLoc(1))
    with pytest.raises(ProtocolError, match="must be a map"):
        TensorDesc.from_wire([1], limits, 2)
    with pytest.raises(ProtocolError, match="no tensor frames"):
        TensorDesc.from_wire({"dtype": "int64", "shape": [1], "loc": "inline", "frame": 1}, limits, 1)


# ----------------------------------------------------------------------------- server-side validation


def test_chunk_result_needs_exactly_one_of_audio_and_error() -> None:
    both = {"stream_id": "a", "seq": 0, "num_frames": 0, "audio": {"dtype": "float32", "shape": [0], "loc": "inline",
                                                                   "frame": 1}, "error": {"code": "busy", "message": ""}}
    frames = header_frames({"type": "decode_result", "request_id": 4, "results": [both]}, b"")
    error = expect_error(frames, ErrorCode.INVALID_ARGUMENT, "exactly one of 'audio' and 'error'", server=True)
    assert error.request_id == 4
    neither = {"stream_id": "a", "seq": 0, "num_frames": 0}
    expect_error(header_frames({"type": "decode_result", "request_id": 4, "results": [neither]}),
                 ErrorCode.INVALID_ARGUMENT, "exactly one of", server=True)


def test_audio_must_be_float32_rank1_with_matching_frame() -> None:
    bad = ChunkResult("a", 0, TensorDesc("int16", (4,), InlineLoc(1)), 1)
    expect_error(encode(DecodeResult(1, (bad,)), [bytes(8)]), ErrorCode.INVALID_ARGUMENT, "audio must be float32",
                 server=True)
    short = ChunkResult("a", 0, TensorDesc("float32", (4,), InlineLoc(1)), 1)
    expect_error(encode(DecodeResult(1, (short,)), [bytes(12)]), ErrorCode.INVALID_ARGUMENT, "holds 12 bytes",
                 server=True)


def test_welcome_validation() -> None:
    wire = welcome().to_wire()
    wire["heartbeat_interval_s"] = 0
    expect_error(header_frames(wire), ErrorCode.INVALID_ARGUMENT, "heartbeat_interval_s must be a finite number > 0",
                 server=True)
    wire = welcome().to_wire()
    wire["models"][0]["samples_per_frame"] = "1920"
    expect_error(header_frames(wire), ErrorCode.INVALID_ARGUMENT, "models[0].samples_per_frame must be an integer",
                 server=True)


def test_error_with_nil_request_id() -> None:
    frames = encode(Error(None, ErrorCode.INVALID_ARGUMENT, "bad"))
    decoded = decode_server_message(frames)
    assert decoded == Error(None, ErrorCode.INVALID_ARGUMENT, "bad")
    assert msgpack.unpackb(frames[0])["request_id"] is None


def test_error_code_values_are_stable() -> None:
    assert {code.value for code in ErrorCode} == {
        "invalid_argument", "not_found", "already_exists", "out_of_order", "busy", "deadline_exceeded",
        "unavailable", "internal", "version_mismatch", "stream_lost",
    }
    error = ProtocolError(ErrorCode.BUSY, "full", 3)
    assert (str(error), error.request_id) == ("busy: full", 3)
    assert error.with_request_id(4) is error
    assert ProtocolError(ErrorCode.BUSY, "x").with_request_id(5).request_id == 5
