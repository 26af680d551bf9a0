"""CPU tests for the protocol side of CUDA IPC: region messages, chunk/result IPC fields, strictness."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from code2wav.proto import (
    Chunk,
    ChunkResult,
    CudaIpcLoc,
    Decode,
    DecodeResult,
    ErrorCode,
    InlineLoc,
    ProtocolError,
    RegionRegistered,
    RegionUnregistered,
    RegisterRegion,
    TensorDesc,
    UnregisterRegion,
    decode_client_message,
    decode_server_message,
    encode,
)

HANDLE = "ab" * 64
EVENT = "0f" * 64
DOORBELLS = "code2wav-doorbells-4242-" + "0123456789abcdef01234567"


def raw(header: dict[str, Any], *frames: bytes) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *frames]


def register_header(**changes: Any) -> dict[str, Any]:
    header = {"type": "register_region", "request_id": 9, "gpu_uuid": "GPU-1234", "ipc_handle": HANDLE,
              "nbytes": 1 << 20, "access": "read", "events": [EVENT, EVENT]}
    header.update(changes)
    return {k: v for k, v in header.items() if v is not ...}


def test_region_messages_round_trip() -> None:
    msgs = [RegisterRegion(1, "GPU-1", HANDLE, 4096, "read", (EVENT,)), RegisterRegion(2, "GPU-1", HANDLE, 8, "write"),
            UnregisterRegion(3, 17)]
    for msg in msgs:
        assert decode_client_message(encode(msg)) == msg
    for reply in [RegionRegistered(1, 17, (EVENT, HANDLE)), RegionRegistered(2, 18), RegionUnregistered(3, 17),
                  RegionRegistered(4, 19, (), DOORBELLS)]:  # a read region's doorbells
        assert decode_server_message(encode(reply)) == reply
    assert "doorbells" not in RegionRegistered(2, 18).to_wire()  # a server that arms nothing sends none


@pytest.mark.parametrize("name", [
    HANDLE,  # (what the field held before the words moved to host memory)
    "../../etc/passwd", "/dev/shm/" + DOORBELLS, DOORBELLS + "/x", DOORBELLS[:-1], DOORBELLS.upper(),
    "code2wav-doorbells--" + "0" * 24, "",
])
def test_doorbells_are_a_doorbell_files_name_and_nothing_else(name: str) -> None:
    """A client opens the file this names in /dev/shm: a path, another file's name or any other text is refused by
    the decoder, before the client sees it."""
    wire = RegionRegistered(4, 19, (), DOORBELLS).to_wire()
    wire["doorbells"] = name
    with pytest.raises(ProtocolError, match="region_registered.doorbells"):
        decode_server_message(raw(wire))


@pytest.mark.parametrize("changes, needle", [
    ({"ipc_handle": "ab" * 63}, "ipc_handle must be 128 lowercase hex"),
    ({"ipc_handle": "AB" * 64}, "ipc_handle must be 128 lowercase hex"),
    ({"nbytes": 0}, "nbytes must be in"),
    ({"nbytes": True}, "nbytes must be an integer"),
    ({"access": "rw"}, "access must be one of"),
    ({"events": []}, "must hold 1..64 event handles"),
    ({"events": [EVENT] * 65}, "the limit is 64"),
    ({"events": ["zz" * 64]}, "events[0] must be 128"),
    ({"access": "write"}, "must be empty for a write region"),
    ({"gpu_uuid": ...}, "missing required key 'gpu_uuid'"),
    ({"extra": 1}, "unknown key 'extra'"),
])
def test_register_region_rejects(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(raw(register_header(**changes)))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert needle in info.value.message
    assert info.value.request_id == 9  # scoped to the request


def test_unregister_region_rejects_bad_id() -> None:
    with pytest.raises(ProtocolError, match="region_id must be in"):
        decode_client_message(raw({"type": "unregister_region", "request_id": 1, "region_id": -1}))


def ipc_codes(**changes: Any) -> dict[str, Any]:
    desc = {"dtype": "int64", "shape": [16, 25], "loc": "cuda_ipc", "region": 3, "offset": 0, "nbytes": 3200}
    desc.update(changes)
    return desc


def chunk_header(**chunk_changes: Any) -> dict[str, Any]:
    chunk = {"stream_id": "s", "seq": 0, "codes": ipc_codes(), "codes_event": 1}
    chunk.update(chunk_changes)
    chunk = {k: v for k, v in chunk.items() if v is not ...}
    return {"type": "decode", "request_id": 4, "chunks": [chunk]}


def test_chunk_with_ipc_codes_and_audio_out() -> None:
    audio_out = {"dtype": "float32", "shape": [48000], "loc": "cuda_ipc", "region": 4, "offset": 256,
                 "nbytes": 192000}
    msg = decode_client_message(raw(chunk_header(audio_out=audio_out)))
    assert isinstance(msg, Decode)
    chunk = msg.chunks[0]
    assert chunk.codes.loc == CudaIpcLoc(3, 0, 3200) and chunk.codes_event == 1
    assert chunk.audio_out == TensorDesc("float32", (48000,), CudaIpcLoc(4, 256, 192000))
    assert decode_client_message(encode(msg)) == msg


@pytest.mark.parametrize("changes, needle", [
    ({"codes_event": ...}, "missing required key 'codes_event'"),
    ({"codes_event": 64}, "codes_event must be in [0, 63]"),
    ({"codes_token": 7}, "codes_token must be even (the server releases a doorbell with the odd token + 1), got 7"),
    ({"codes_token": 0}, "codes_token must be in [2, 4294967294]"),
    ({"codes_token": 1 << 32}, "codes_token must be in [2, 4294967294]"),
    ({"codes": ipc_codes(nbytes=3199)}, "nbytes is 3199 but"),
    ({"audio_out": {"dtype": "float32", "shape": [4], "loc": "inline", "frame": 1}}, "inline tensor descriptor in a"),
    ({"audio_out": {"dtype": "int64", "shape": [4], "loc": "cuda_ipc", "region": 1, "offset": 0, "nbytes": 32}},
     "audio_out must be float32"),
])
def test_ipc_chunk_rejects(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_message(raw(chunk_header(**changes)))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and needle in info.value.message


def test_codes_event_not_allowed_with_inline_codes() -> None:
    inline = {"dtype": "int16", "shape": [1, 2], "loc": "inline", "frame": 1}
    with pytest.raises(ProtocolError, match="codes_event is only allowed with cuda_ipc codes"):
        decode_client_message(raw(chunk_header(codes=inline), b"\0" * 4))
    with pytest.raises(ProtocolError, match="codes_token is only allowed with cuda_ipc codes"):
        decode_client_message(raw(chunk_header(codes=inline, codes_event=..., codes_token=2), b"\0" * 4))


def test_an_armed_chunk_round_trips_and_stays_off_the_wire_unarmed() -> None:
    msg = decode_client_message(raw(chunk_header(codes_token=(1 << 32) - 2)))
    assert msg.chunks[0].codes_token == (1 << 32) - 2 and msg.chunks[0].codes_event == 1
    assert decode_client_message(encode(msg)) == msg
    assert "codes_token" not in decode_client_message(raw(chunk_header())).chunks[0].to_wire()


def test_result_with_ipc_audio_needs_its_event() -> None:
    audio = TensorDesc("float32", (1920,), CudaIpcLoc(2, 512, 7680))
    good = DecodeResult(5, (ChunkResult("s", 0, audio, 1, audio_event=7),))
    assert decode_server_message(encode(good)) == good
    bad = DecodeResult(5, (ChunkResult("s", 0, audio, 1),))
    with pytest.raises(ProtocolError, match="missing required key 'audio_event'"):
        decode_server_message(encode(bad))
    inline = DecodeResult(6, (ChunkResult("s", 0, TensorDesc("float32", (1,), InlineLoc(1)), 0),))
    assert decode_server_message(encode(inline, [b"\0" * 4])).results[0].audio_event is None


def test_hello_keeps_host_id() -> None:
    header = {"type": "hello", "request_id": 1, "version": 1, "client_id": "c",
              "capabilities": {"cuda_ipc": True, "gpu_uuid": "GPU-1", "host_id": "boot-1", "future": 1}}
    msg = decode_client_message(raw(header))
    assert msg.capabilities == {"cuda_ipc": True, "gpu_uuid": "GPU-1", "host_id": "boot-1"}


def test_chunk_defaults_stay_off_the_wire() -> None:
    chunk = Chunk("s", 0, TensorDesc("int64", (1, 1), InlineLoc(1)))
    assert "codes_event" not in chunk.to_wire() and "audio_out" not in chunk.to_wire()
