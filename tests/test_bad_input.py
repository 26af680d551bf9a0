"""The bad-input matrix: malformed and hostile messages each get the right typed error (or a clean drop);
the server stays up; a healthy stream decoding alongside produces bit-identical audio to a clean run."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from code2wav import proto
from code2wav.client import SidecarClient
from conftest import start_sidecar
from test_server_e2e import RawPeer

E = proto.ErrorCode
Q, K = 4, 64  # tiny model: quantizers, codebook size


def codes_desc(shape, dtype="int64", frame=1):
    return {"dtype": dtype, "shape": shape, "loc": "inline", "frame": frame}


def chunk(stream_id="x", seq=0, codes=None, **extra):
    return {"stream_id": stream_id, "seq": seq, "final": False, "context_frames": 0,
            "codes": codes or codes_desc([Q, 5]), **extra}


def decode(rid, *chunks):
    return {"type": "decode", "request_id": rid, "chunks": list(chunks)}


GOOD = np.arange(Q * 5, dtype="<i8").reshape(Q, 5) % K
GOOD_BYTES = GOOD.tobytes()


def open_msg(rid, stream_id="x", **over):
    msg = {"type": "open_stream", "request_id": rid, "stream_id": stream_id, "model": None, "mode": "exact",
           "left_context_frames": 0}
    msg.update(over)
    return msg


class Ext:
    pass


# (name, frames to send, expected code, level) -- level "msg": an Error reply; "chunk": a per-chunk error
CASES = [
    ("not msgpack", [b"\xc1\xc1\xc1"], E.INVALID_ARGUMENT, "msg"),
    ("truncated msgpack", [msgpack.packb(open_msg(1))[:-3]], E.INVALID_ARGUMENT, "msg"),
    ("header is a list", [msgpack.packb([1, 2, 3])], E.INVALID_ARGUMENT, "msg"),
    ("header without type", [msgpack.packb({"request_id": 1})], E.INVALID_ARGUMENT, "msg"),
    ("unknown type", [msgpack.packb({"type": "explode", "request_id": 1})], E.INVALID_ARGUMENT, "msg"),
    ("type is an int", [msgpack.packb({"type": 7, "request_id": 1})], E.INVALID_ARGUMENT, "msg"),
    ("negative request id", [msgpack.packb({"type": "ping", "request_id": -1})], E.INVALID_ARGUMENT, "msg"),
    ("bool request id", [msgpack.packb({"type": "ping", "request_id": True})], E.INVALID_ARGUMENT, "msg"),
    ("float request id", [msgpack.packb({"type": "ping", "request_id": 1.5})], E.INVALID_ARGUMENT, "msg"),
    ("unknown key", [msgpack.packb({**open_msg(2, "y"), "evil": 1})], E.INVALID_ARGUMENT, "msg"),
    ("wrong protocol version", [msgpack.packb({"type": "hello", "request_id": 3, "version": 99,
                                               "client_id": "x", "capabilities": {}})], E.VERSION_MISMATCH, "msg"),
    ("bad mode", [msgpack.packb(open_msg(4, "y", mode="fast"))], E.INVALID_ARGUMENT, "msg"),
    ("negative left context", [msgpack.packb(open_msg(5, "y", mode="window", left_context_frames=-1))],
     E.INVALID_ARGUMENT, "msg"),
    ("huge left context", [msgpack.packb(open_msg(5, "y", mode="window", left_context_frames=10**9))],
     E.INVALID_ARGUMENT, "msg"),
    ("stream id too long", [msgpack.packb(open_msg(6, "s" * 5000))], E.INVALID_ARGUMENT, "msg"),
    ("empty stream id", [msgpack.packb(open_msg(7, ""))], E.INVALID_ARGUMENT, "msg"),
    ("duplicate stream id, other parameters", [msgpack.packb(open_msg(8, "x", mode="window", left_context_frames=3))],
     E.ALREADY_EXISTS, "msg"),  # (the same open again, before a chunk, is answered again: test_server_e2e)
    ("unknown model", [msgpack.packb(open_msg(9, "y", model="whisper"))], E.NOT_FOUND, "msg"),
    ("no chunks", [msgpack.packb(decode(10))], E.INVALID_ARGUMENT, "msg"),
    ("codes rank 3", [msgpack.packb(decode(11, chunk(codes=codes_desc([1, Q, 5])))), GOOD_BYTES],
     E.INVALID_ARGUMENT, "msg"),
    ("huge declared shape", [msgpack.packb(decode(12, chunk(codes=codes_desc([Q, 10**12])))), GOOD_BYTES],
     E.INVALID_ARGUMENT, "msg"),
    ("negative dim", [msgpack.packb(decode(13, chunk(codes=codes_desc([Q, -5])))), GOOD_BYTES],
     E.INVALID_ARGUMENT, "msg"),
    ("frame index out of range", [msgpack.packb(decode(14, chunk(codes=codes_desc([Q, 5], frame=3)))), GOOD_BYTES],
     E.INVALID_ARGUMENT, "msg"),
    ("truncated tensor frame", [msgpack.packb(decode(15, chunk())), GOOD_BYTES[:-8]], E.INVALID_ARGUMENT, "msg"),
    ("nbytes larger than declared", [msgpack.packb(decode(16, chunk())), GOOD_BYTES + b"\0" * 8],
     E.INVALID_ARGUMENT, "msg"),
    ("unsupported dtype string", [msgpack.packb(decode(17, chunk(codes=codes_desc([Q, 5], dtype="complex128")))),
                                  GOOD_BYTES], E.INVALID_ARGUMENT, "msg"),
    ("msgpack ext type", [msgpack.packb({"type": "ping", "request_id": msgpack.ExtType(5, b"boom")})],
     E.INVALID_ARGUMENT, "msg"),
    ("seq is a string", [msgpack.packb(decode(18, chunk(seq="0"))), GOOD_BYTES], E.INVALID_ARGUMENT, "msg"),
    ("context frames beyond chunk", [msgpack.packb(decode(19, chunk(context_frames=6))), GOOD_BYTES],
     E.INVALID_ARGUMENT, "msg"),
    ("empty non-final chunk", [msgpack.packb(decode(20, chunk(codes=codes_desc([Q, 0])))), b""],
     E.INVALID_ARGUMENT, "msg"),
    ("wrong number of quantizers", [msgpack.packb(decode(21, chunk(codes=codes_desc([3, 5])))), GOOD_BYTES[:3 * 40]],
     E.INVALID_ARGUMENT, "chunk"),
    ("code out of range", [msgpack.packb(decode(22, chunk())), np.full((Q, 5), K, "<i8").tobytes()],
     E.INVALID_ARGUMENT, "chunk"),
    ("negative code", [msgpack.packb(decode(23, chunk())), np.full((Q, 5), -1, "<i8").tobytes()],
     E.INVALID_ARGUMENT, "chunk"),
    # float dtypes are wire dtypes (latents families take float32/bfloat16): a codes model refuses them per chunk
    ("float codes", [msgpack.packb(decode(24, chunk(codes=codes_desc([Q, 5], dtype="float32")))),
                     np.zeros((Q, 5), "<f4").tobytes()], E.INVALID_ARGUMENT, "chunk"),
    ("float16 codes", [msgpack.packb(decode(24, chunk(codes=codes_desc([Q, 5], dtype="float16")))),
                       np.zeros((Q, 5), "<f2").tobytes()], E.INVALID_ARGUMENT, "chunk"),
    ("bfloat16 codes", [msgpack.packb(decode(24, chunk(codes=codes_desc([Q, 5], dtype="bfloat16")))),
                        np.zeros((Q, 5), "<u2").tobytes()], E.INVALID_ARGUMENT, "chunk"),
    ("unknown stream", [msgpack.packb(decode(25, chunk(stream_id="ghost"))), GOOD_BYTES], E.NOT_FOUND, "chunk"),
    ("seq gap", [msgpack.packb(decode(26, chunk(seq=7))), GOOD_BYTES], E.OUT_OF_ORDER, "chunk"),
    ("cuda ipc region not offered", [msgpack.packb(decode(27, chunk(codes={"dtype": "int64", "shape": [Q, 5],
                                                                            "loc": "cuda_ipc", "region": 1,
                                                                            "offset": 0, "nbytes": 160},
                                                                     codes_event=0)))],
     E.INVALID_ARGUMENT, "chunk"),
    ("register region on a CPU sidecar", [msgpack.packb({"type": "register_region", "request_id": 27,
                                                          "gpu_uuid": "GPU-0", "ipc_handle": "00" * 64,
                                                          "nbytes": 4096, "access": "write", "events": []})],
     E.INVALID_ARGUMENT, "msg"),
    ("unregister unknown region", [msgpack.packb({"type": "unregister_region", "request_id": 27,
                                                   "region_id": 5})], E.NOT_FOUND, "msg"),
    ("finish unknown stream", [msgpack.packb({"type": "finish", "request_id": 28, "stream_id": "ghost"})],
     E.NOT_FOUND, "msg"),
    ("abort unknown stream", [msgpack.packb({"type": "abort", "request_id": 29, "stream_id": "ghost"})],
     E.NOT_FOUND, "msg"),
]


def _healthy_plan():
    return [(0, 3), (3, 11), (11, 12), (12, 30), (30, 40)]


def _healthy_run(client, codes, name, between=None):
    s = client.open_stream(name)
    pieces = []
    plan = _healthy_plan()
    for i, (a, b) in enumerate(plan):
        if between is not None:
            between(i)
        pieces.append(s.decode(codes[:, a:b], final=(b == 40)))
    return torch.cat(pieces)


@pytest.fixture(scope="module")
def matrix_sidecar(tmp_path_factory):
    running = start_sidecar(tmp_path_factory.mktemp("matrix"))
    yield running
    running.stop()


def test_matrix_has_at_least_30_distinct_cases():
    assert len({name for name, *_ in CASES}) == len(CASES) >= 30


def test_bad_input_matrix_typed_errors_and_healthy_stream_bit_identical(matrix_sidecar, golden_cases):
    codes = golden_cases["codes"][1]
    with SidecarClient(matrix_sidecar.address, timeout_s=30) as client:
        clean = _healthy_run(client, codes, "clean")
        peer = RawPeer(matrix_sidecar.address)
        try:
            peer.send(msgpack.packb(open_msg(99, "x")))  # before the handshake
            reply = peer.recv()
            assert isinstance(reply, proto.Error) and reply.code == E.INVALID_ARGUMENT and "hello" in reply.message
            peer.hello()
            peer.send(msgpack.packb(open_msg(100, "x")))
            assert isinstance(peer.recv(), proto.Opened)
            outcomes = {}
            per_step = (len(CASES) + len(_healthy_plan()) - 1) // len(_healthy_plan())

            def inject(step):
                for name, frames, code, level in CASES[step * per_step:(step + 1) * per_step]:
                    peer.sock.send_multipart(frames)
                    reply = peer.recv()
                    if level == "msg":
                        assert isinstance(reply, proto.Error), (name, reply)
                        outcomes[name] = reply.code
                    else:
                        assert isinstance(reply, proto.DecodeResult), (name, reply)
                        outcomes[name] = reply.results[0].error.code
                    assert outcomes[name] == code, (name, outcomes[name], getattr(reply, "message", reply))

            dirty = _healthy_run(client, codes, "healthy", between=inject)
            inject(len(_healthy_plan()))  # any cases left over
            assert set(outcomes) == {name for name, *_ in CASES}
            # the raw peer's own stream still works, from seq 0: none of the bad chunks advanced it
            peer.send(msgpack.packb(decode(200, chunk())), GOOD_BYTES)
            ok = peer.recv()
            assert isinstance(ok, proto.DecodeResult) and ok.results[0].error is None
        finally:
            peer.close()
    assert torch.equal(clean, dirty)  # bit-identical to the clean run
    text = matrix_sidecar.scrape()
    assert "code2wav_sidecar_errors_total" in text


def test_oversized_and_too_many_frames_and_flood(matrix_sidecar):
    peer = RawPeer(matrix_sidecar.address)
    try:
        peer.hello()
        limits = proto.Limits()
        peer.sock.send_multipart([msgpack.packb(decode(1, chunk())), b"\0" * (limits.max_message_bytes + 8)])
        reply = peer.recv()
        assert isinstance(reply, proto.Error) and reply.code == E.INVALID_ARGUMENT
        peer.sock.send_multipart([msgpack.packb({"type": "ping", "request_id": 2})] + [b""] * 2000)
        reply = peer.recv()
        assert isinstance(reply, proto.Error) and reply.code == E.INVALID_ARGUMENT
        big_header = msgpack.packb({"type": "ping", "request_id": 3, "pad": "x" * (limits.max_header_bytes + 1)})
        peer.sock.send_multipart([big_header])
        assert isinstance(peer.recv(), proto.Error)
        peer.sock.send_multipart([b""])  # an empty header frame
        assert isinstance(peer.recv(), proto.Error)
        # a flood of 3000 pings: every one answered, nothing lost, the server stays responsive
        for i in range(3000):
            peer.sock.send_multipart([msgpack.packb({"type": "ping", "request_id": 10_000 + i})])
        got = {peer.recv().request_id for _ in range(3000)}
        assert got == set(range(10_000, 13_000))
    finally:
        peer.close()
    with SidecarClient(matrix_sidecar.address, timeout_s=10) as client:
        assert client.ping() < 5


def test_per_client_pending_limit_is_busy(tmp_path, golden_cases):
    config = tmp_path / "limits.yaml"
    config.write_text("limits:\n  max_pending_chunks_per_client: 2\nscheduler:\n  batch_window_us: 200000\n")
    running = start_sidecar(tmp_path, "--config", str(config))
    codes = golden_cases["codes"][0]
    try:
        with SidecarClient(running.address, timeout_s=30) as greedy, SidecarClient(running.address) as polite:
            streams = [greedy.open_stream(f"g{i}") for i in range(5)]
            outs = greedy.decode_batch([(s, codes[:, :5]) for s in streams], return_exceptions=True)
            kinds = [type(o).__name__ for o in outs]
            assert kinds.count("Busy") == 3 and kinds.count("Tensor") == 2, kinds
            assert "max_pending_chunks_per_client" in str(next(o for o in outs if not isinstance(o, torch.Tensor)))
            other = polite.open_stream("p")  # another client is not limited by the greedy one
            assert other.decode(codes[:, :5]).numel() == 5 * 48
    finally:
        running.stop()
