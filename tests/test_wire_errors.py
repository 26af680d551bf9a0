"""Errors name the wire's words (issue 22, items 2 and 5): limits by their ``welcome.limits`` names with the
request id kept, messages before the handshake by their wire type, and an ``audio_out`` in a CUDA IPC region on
a server without CUDA IPC is ``invalid_argument`` (protocol section 3), not ``not_found``."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from code2wav import proto
from code2wav.proto import ErrorCode, Limits, ProtocolError
from test_server_e2e import RawPeer

Q, K = 4, 64  # tiny model: quantizers, codebook size
CODES = (np.arange(Q * 5, dtype="<i8").reshape(Q, 5) % K).tobytes()  # [Q, 5]


def _chunk(stream_id: str, seq: int = 0, frame: int = 1, **extra) -> dict:
    return {"stream_id": stream_id, "seq": seq, "final": False, "context_frames": 0,
            "codes": {"dtype": "int64", "shape": [Q, 5], "loc": "inline", "frame": frame}, **extra}


def _decode_frames(request_id: int, num_chunks: int) -> list[bytes]:
    """A decode of ``num_chunks`` chunks, one tensor frame each (so num_chunks + 1 frames)."""
    chunks = [_chunk(f"s{i}", frame=i + 1) for i in range(num_chunks)]
    return [msgpack.packb({"type": "decode", "request_id": request_id, "chunks": chunks}), *[CODES] * num_chunks]


@pytest.mark.parametrize("num_frames_extra", [0, 1])
def test_too_many_chunks_names_the_limit_and_keeps_the_request_id(num_frames_extra):
    limits = Limits()
    frames = _decode_frames(77, limits.max_chunks_per_message + 1)[: limits.max_chunks_per_message + 1
                                                                    + num_frames_extra]
    with pytest.raises(ProtocolError) as info:
        proto.decode_client_message(frames, limits)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.request_id == 77
    assert "max_chunks_per_message" in info.value.message and "1025 entries" in info.value.message
    assert "max_array_len" not in info.value.message


def test_limit_errors_name_their_wire_limit():
    cases = [
        (_decode_frames(5, 3), Limits(max_frames_per_message=3), "max_frames_per_message"),  # 4 frames
        ([msgpack.packb({"type": "ping", "request_id": 6}), b"x" * 3000], Limits(max_message_bytes=2000),
         "max_message_bytes"),
        (_decode_frames(7, 1), Limits(max_chunk_frames=4), "max_chunk_frames"),  # 5 frames in a chunk
    ]
    for frames, limits, limit_name in cases:
        with pytest.raises(ProtocolError) as info:
            proto.decode_client_message(frames, limits)
        assert limit_name in info.value.message, info.value.message
    wide = [msgpack.packb({"type": "decode", "request_id": 8, "chunks": [
        {**_chunk("a"), "codes": {"dtype": "int64", "shape": [1] * 5, "loc": "inline", "frame": 1}}]}), CODES]
    with pytest.raises(ProtocolError, match="max_rank"):
        proto.decode_client_message(wide)


def test_server_answers_1025_chunks_with_the_limit_name(sidecar):
    peer = RawPeer(sidecar.address)
    try:
        peer.hello()
        peer.sock.send_multipart(_decode_frames(4242, 1025))
        reply = peer.recv()
        assert isinstance(reply, proto.Error)
        assert reply.code == ErrorCode.INVALID_ARGUMENT and reply.request_id == 4242
        assert "max_chunks_per_message" in reply.message and "max_array_len" not in reply.message
        peer.send(proto.Ping(4243))  # still served
        assert isinstance(peer.recv(), proto.Pong)
    finally:
        peer.close()


def test_before_the_handshake_errors_use_wire_names(sidecar):
    peer = RawPeer(sidecar.address)
    try:
        sent = {
            "ping": {"type": "ping", "request_id": 1},
            "open_stream": {"type": "open_stream", "request_id": 2, "stream_id": "x"},
            "decode": {"type": "decode", "request_id": 3, "chunks": [_chunk("x")]},
            "finish": {"type": "finish", "request_id": 4, "stream_id": "x"},
            "unregister_region": {"type": "unregister_region", "request_id": 5, "region_id": 1},
        }
        for wire_name, header in sent.items():
            peer.send(header, *([CODES] if wire_name == "decode" else []))
            reply = peer.recv()
            assert isinstance(reply, proto.Error) and reply.code == ErrorCode.INVALID_ARGUMENT
            assert reply.request_id == header["request_id"]
            assert reply.message.startswith(f"{wire_name} before the handshake"), reply.message
            for class_name in ("Ping", "OpenStream", "Decode", "Finish", "UnregisterRegion"):
                assert class_name not in reply.message
    finally:
        peer.close()


def test_audio_out_region_without_cuda_ipc_is_invalid_argument(sidecar):
    peer = RawPeer(sidecar.address)
    try:
        welcome = peer.hello()
        assert not welcome.capabilities.get("cuda_ipc")  # a CPU sidecar
        peer.send({"type": "open_stream", "request_id": 2, "stream_id": "a"})
        assert isinstance(peer.recv(), proto.Opened)
        num_samples = 5 * welcome.models[0].samples_per_frame
        audio_out = {"dtype": "float32", "shape": [num_samples], "loc": "cuda_ipc", "region": 0, "offset": 0,
                     "nbytes": 4 * num_samples}
        peer.send({"type": "decode", "request_id": 3, "chunks": [_chunk("a", audio_out=audio_out)]}, CODES)
        reply = peer.recv()
        assert isinstance(reply, proto.DecodeResult) and reply.request_id == 3
        error = reply.results[0].error
        assert error is not None and error.code == ErrorCode.INVALID_ARGUMENT, error
        assert "cuda_ipc" in error.message and "not supported" in error.message
        peer.send({"type": "decode", "request_id": 4, "chunks": [_chunk("a")]}, CODES)  # the stream is intact
        ok = peer.recv()
        assert isinstance(ok, proto.DecodeResult) and ok.results[0].error is None
    finally:
        peer.close()
