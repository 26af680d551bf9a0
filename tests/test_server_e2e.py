"""End to end over real ZeroMQ sockets (ipc:// in a temp dir) against a real sidecar process (tiny model, CPU)."""

from __future__ import annotations

import concurrent.futures
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from code2wav import proto
from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from conftest import start_sidecar
from code2wav.loadgen.server_metrics import metric_value as _metric

TOL = 1e-5


def _window_stream(client: SidecarClient, name: str, codes: torch.Tensor, chunk_frames: int = 12) -> torch.Tensor:
    stream = client.open_stream(name, mode="window", left_context_frames=5)
    pieces = []
    num_frames = codes.shape[1]
    for start in range(0, num_frames, chunk_frames):
        end = min(start + chunk_frames, num_frames)
        pieces.append(stream.decode(codes[:, start:end], final=(end == num_frames)))
    return torch.cat(pieces)


def test_eight_concurrent_window_streams_reproduce_golden_chunked(sidecar, golden_cases):
    codes, chunked = golden_cases["codes"], golden_cases["chunked"][:, 0]
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_window_stream, client, f"w{i}", codes[i % 2]) for i in range(8)]
            outs = [f.result() for f in futures]
    for i, out in enumerate(outs):
        assert out.shape == chunked[i % 2].shape
        assert (out - chunked[i % 2]).abs().max().item() <= TOL, i


def test_exact_streams_batch_and_context_frames(sidecar, golden_cases):
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    spf = 48
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        a = client.open_stream("a")  # exact is the default
        b = client.open_stream("b")
        assert a.mode == "exact"
        # one round trip, two streams; b marks 4 reference frames as context
        first = client.decode_batch([(a, codes[0, :, :1]), (b, codes[1, :, :10], {"context_frames": 4})])
        assert first[0].numel() == spf and first[1].numel() == 6 * spf
        rest = client.decode_batch([(a, codes[0, :, 1:40], {"final": True}), (b, codes[1, :, 10:40], {"final": True})])
        out_a = torch.cat([first[0], rest[0]])
        out_b = torch.cat([first[1], rest[1]])
    assert (out_a - full[0]).abs().max().item() <= TOL
    assert (out_b - full[1, 4 * spf:]).abs().max().item() <= TOL


def test_metrics_move_and_health_endpoints(sidecar, golden_cases):
    assert sidecar.http_status("/healthz") == 200
    assert sidecar.http_status("/readyz") == 200
    before = sidecar.scrape()
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        s = client.open_stream("m")
        s.decode(golden_cases["codes"][0, :, :25])
        during = sidecar.scrape()
        assert _metric(during, "code2wav_sidecar_active_streams") == 1
        s.decode(golden_cases["codes"][0, :, 25:40], final=True)
    after = sidecar.scrape()
    assert _metric(after, "code2wav_sidecar_chunks_total", mode="exact") - _metric(before, "code2wav_sidecar_chunks_total", mode="exact") == 2
    audio_s = _metric(after, "code2wav_sidecar_audio_seconds_total") - _metric(before, "code2wav_sidecar_audio_seconds_total")
    assert audio_s == pytest.approx(40 * 48 / 24000)
    assert _metric(after, "code2wav_sidecar_chunk_latency_seconds_count", mode="exact") >= 2
    assert _metric(after, "code2wav_sidecar_active_streams") == 0
    assert 'le="0.0005"' in after  # latency buckets start at 0.5 ms
    assert _metric(after, "code2wav_sidecar_input_pickups_total", how="polled") == 0  # busy polling: CUDA only
    assert _metric(after, "code2wav_sidecar_input_pickups_total", how="woken") >= 3
    assert sidecar.http_status("/nope") == 404


def test_resend_is_idempotent_and_failures_commit_nothing(sidecar, golden_cases):
    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]
    spf = 48
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        s = client.open_stream("r")
        first = s.decode(codes[:, :10])
        again = s.resend()  # same seq again: same audio, state not advanced
        assert torch.equal(first, again)
        bad = codes[:, 10:20].clone()
        bad[2, 3] = 64  # codebook_size is 64 in the tiny model
        with pytest.raises(cerr.InvalidArgument, match="out of range"):
            s.decode(bad)
        rest = s.decode(codes[:, 10:40], final=True)  # continues exactly as if the bad chunk never happened
    assert (torch.cat([first, rest]) - full).abs().max().item() <= TOL
    assert first.numel() == 10 * spf


def test_a_repeated_open_is_answered_again_until_the_first_chunk(sidecar, golden_cases):
    """A client that lost an open's answer (a timeout, a restart race) may send it again: same id and
    parameters before any chunk get ``opened`` again (one stream, one slot); other parameters, or an open after
    a chunk, get already_exists. The Python client refuses a second open of an id whose Stream is still live in
    it (two seq counters on one server stream would take each other's chunks for resends)."""
    import gc

    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        first = client.open_stream("again")
        with pytest.raises(cerr.AlreadyExists, match="already open in this client"):
            client.open_stream("again")  # refused in the client: `first` is live
        del first  # as if its answer had been lost: no Stream object for it in this client
        gc.collect()
        stream = client.open_stream("again")  # the repeat: the server answers it, the same stream
        assert _metric(sidecar.scrape(), "code2wav_sidecar_active_streams") == 1
        assert _metric(sidecar.scrape(), "code2wav_sidecar_arena_slots", kind="used") == 1
        head = stream.decode(codes[:, :10])
        del stream
        gc.collect()
        with pytest.raises(cerr.AlreadyExists, match="taken chunks"):
            client.open_stream("again")  # the server's refusal: the stream is past its first chunk
        with pytest.raises(cerr.AlreadyExists, match="other parameters"):
            client.open_stream("again", mode="window", left_context_frames=5)
        assert _metric(sidecar.scrape(), "code2wav_sidecar_active_streams") == 1
    assert head.numel() == 10 * 48 and (head - full[: 10 * 48]).abs().max().item() <= TOL


def test_a_repeated_open_restarts_the_idle_clock(tmp_path, golden_cases):
    """The stream a repeated open was just answered for is not reaped as idle right after (TTL 2 s: repeated at
    1.6 s, used 0.9 s later)."""
    import gc

    running = start_sidecar(tmp_path, "--stream-ttl-s", "2")
    try:
        with SidecarClient(running.address, timeout_s=30) as client:
            client.open_stream("idle")
            gc.collect()  # (that Stream object is gone: as if the answer had been lost)
            time.sleep(1.6)
            stream = client.open_stream("idle")
            time.sleep(0.9)
            codes = golden_cases["codes"][0]
            assert stream.decode(codes[:, :5]).numel() == 5 * 48
    finally:
        running.stop()


def test_ttl_reaps_idle_streams_and_arena_full_is_busy(tmp_path, golden_cases):
    from conftest import start_sidecar

    running = start_sidecar(tmp_path, "--stream-ttl-s", "0.5", "--max-streams", "2")
    try:
        with SidecarClient(running.address, timeout_s=30) as client:
            a = client.open_stream("a")
            client.open_stream("b")
            with pytest.raises(cerr.Busy):
                client.open_stream("c")  # the arena is full: a typed busy error, never an OOM
            a.abort()
            c = client.open_stream("c")  # the aborted stream's slot is reused
            c.decode(golden_cases["codes"][0, :, :3])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                text = running.scrape()
                if _metric(text, "code2wav_sidecar_active_streams") == 0:
                    break
                client.ping()  # keep the client alive while its streams go idle
                time.sleep(0.2)
            assert _metric(text, "code2wav_sidecar_active_streams") == 0
            assert _metric(text, "code2wav_sidecar_streams_closed_total", reason="ttl") == 2
            with pytest.raises(cerr.NotFound):
                c.decode(golden_cases["codes"][0, :, 3:6])
    finally:
        running.stop()


class RawPeer:
    """A hand-driven DEALER for inputs the client library refuses to produce."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.connect(address)

    def send(self, header, *buffers: bytes) -> None:
        """``header``: a proto message, a header dict, or packed bytes (sent as they are)."""
        if hasattr(header, "to_wire"):
            header = header.to_wire()
        head = header if isinstance(header, bytes) else msgpack.packb(header)
        self.sock.send_multipart([head, *buffers])

    def recv(self) -> proto.ServerMessage:
        frames = self.sock.recv_multipart()
        return proto.decode_server_message(frames)

    def hello(self) -> proto.Welcome:
        self.send({"type": "hello", "request_id": 1, "version": 1, "client_id": "raw", "capabilities": {}})
        welcome = self.recv()
        assert isinstance(welcome, proto.Welcome)
        return welcome

    def open_stream(self, request_id: int, stream_id: str) -> proto.Opened:
        """An exact stream of the default model, opened after ``hello``."""
        self.send({"type": "open_stream", "request_id": request_id, "stream_id": stream_id, "model": None,
                   "mode": "exact", "left_context_frames": 0})
        opened = self.recv()
        assert isinstance(opened, proto.Opened), opened
        return opened

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _assert_ping_burst_answered(address: str, count: int) -> None:
    """``count`` pings sent without waiting get ``count`` pongs."""
    peer = RawPeer(address)
    try:
        peer.hello()
        for rid in range(100, 100 + count):
            peer.send(proto.Ping(rid))
        got = sorted(msg.request_id for msg in (peer.recv() for _ in range(count)) if isinstance(msg, proto.Pong))
        assert got == list(range(100, 100 + count))
    finally:
        peer.close()


def test_a_burst_larger_than_one_drain_is_answered_in_full(sidecar):
    """The server drains at most 256 messages per wake-up, then yields to its other work and goes on: a burst
    of 700 pings sent without waiting gets 700 pongs."""
    _assert_ping_burst_answered(sidecar.address, 700)


def test_a_busy_polling_sidecar_decodes_exactly_and_drains_bursts(tmp_path, golden_cases):
    """``busy_poll_us`` (on by default on CUDA) forced on here on the CPU, with a window long enough that
    chunks surely arrive inside it: the step loop polls the socket and takes them itself. Concurrent streams
    still match the golden audio, a stream decodes on after an idle gap, a burst larger than one drain is
    answered in full, and the pickups are counted as polled."""
    config = tmp_path / "poll.yaml"
    config.write_text("busy_poll_us: 50000\nscheduler:\n  batch_window_us: 0\n")
    running = start_sidecar(tmp_path, "--config", str(config))
    try:
        codes, chunked = golden_cases["codes"], golden_cases["chunked"][:, 0]
        with SidecarClient(running.address, timeout_s=30) as client:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                outs = list(pool.map(lambda i: _window_stream(client, f"p{i}", codes[i % 2]), range(4)))
            for i, out in enumerate(outs):
                assert (out - chunked[i % 2]).abs().max().item() <= TOL, i
            stream = client.open_stream("gap", mode="window", left_context_frames=5)
            first = stream.decode(codes[0, :, :12])
            time.sleep(0.2)  # idle: the window most likely ends (unless a heartbeat lands in the gap)
            second = stream.decode(codes[0, :, 12:24])
            assert (torch.cat([first, second]) - chunked[0, : 24 * 48]).abs().max().item() <= TOL
        _assert_ping_burst_answered(running.address, 600)
        scraped = running.scrape()
        assert _metric(scraped, "code2wav_sidecar_input_pickups_total", how="polled") >= 1
        assert _metric(scraped, "code2wav_sidecar_input_pickups_total", how="woken") >= 1  # at least the hello
    finally:
        running.stop()


def _chunk_header(rid: int, stream_id: str, seq: int, dtype: str, shape: list, **extra) -> dict:
    return {"type": "decode", "request_id": rid, "chunks": [
        {"stream_id": stream_id, "seq": seq, "final": False, "context_frames": 0,
         "codes": {"dtype": dtype, "shape": shape, "loc": "inline", "frame": 1}, **extra}]}


def _chunk_error(msg) -> proto.ErrorCode:
    assert isinstance(msg, proto.DecodeResult), msg
    assert msg.results[0].error is not None
    return msg.results[0].error.code


def test_bad_inputs_get_typed_errors_while_a_healthy_stream_is_unharmed(sidecar, golden_cases):
    codes, full = golden_cases["codes"][1], golden_cases["full"][1, 0]
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        healthy = client.open_stream("healthy")
        pieces = [healthy.decode(codes[:, :13])]
        peer = RawPeer(sidecar.address)
        try:
            peer.send({"type": "open_stream", "request_id": 2, "stream_id": "x", "model": None, "mode": "exact",
                       "left_context_frames": 0})
            before_hello = peer.recv()
            assert isinstance(before_hello, proto.Error) and before_hello.code == proto.ErrorCode.INVALID_ARGUMENT
            peer.hello()
            peer.open_stream(3, "x")
            good = codes[:, :5].numpy().astype("<i8")
            cases = {
                "wrong Q": (_chunk_header(10, "x", 0, "int64", [3, 5]), codes[:3, :5].numpy().astype("<i8").tobytes()),
                "code out of range": (_chunk_header(11, "x", 0, "int64", [4, 5]), np.full((4, 5), 999, "<i8").tobytes()),
                "wrong dtype": (_chunk_header(12, "x", 0, "float32", [4, 5]), np.zeros((4, 5), "<f4").tobytes()),
                "unknown stream": (_chunk_header(13, "nope", 0, "int64", [4, 5]), good.tobytes()),
                "seq gap": (_chunk_header(14, "x", 3, "int64", [4, 5]), good.tobytes()),
                "nbytes mismatch": (_chunk_header(15, "x", 0, "int64", [4, 5]), good.tobytes()[:-8]),
            }
            expected = {"wrong Q": proto.ErrorCode.INVALID_ARGUMENT,
                        "code out of range": proto.ErrorCode.INVALID_ARGUMENT,
                        "wrong dtype": proto.ErrorCode.INVALID_ARGUMENT, "unknown stream": proto.ErrorCode.NOT_FOUND,
                        "seq gap": proto.ErrorCode.OUT_OF_ORDER, "nbytes mismatch": proto.ErrorCode.INVALID_ARGUMENT}
            for name, (header, payload) in cases.items():
                peer.send(header, payload)
                reply = peer.recv()
                code = reply.code if isinstance(reply, proto.Error) else _chunk_error(reply)
                assert code == expected[name], name
                pieces.append(healthy.decode(codes[:, 13 + 2 * len(pieces) - 2: 13 + 2 * len(pieces)]))
            # malformed header: not msgpack at all
            peer.send(b"\xc1\xc1 definitely not msgpack")
            reply = peer.recv()
            assert isinstance(reply, proto.Error) and reply.code == proto.ErrorCode.INVALID_ARGUMENT
            # oversized frame: declared within limits but the frame is larger than max_message_bytes
            limit = client.limits.max_message_bytes
            peer.send(_chunk_header(20, "x", 0, "int64", [4, 5]), b"\0" * (limit + 8))
            reply = peer.recv()
            assert isinstance(reply, proto.Error) and reply.code == proto.ErrorCode.INVALID_ARGUMENT
            # the raw peer's own stream still works after all that
            peer.send(_chunk_header(21, "x", 0, "int64", [4, 5]), good.tobytes())
            ok = peer.recv()
            assert isinstance(ok, proto.DecodeResult) and ok.results[0].error is None
        finally:
            peer.close()
        done = sum(p.numel() for p in pieces) // 48
        pieces.append(healthy.decode(codes[:, done:], final=True))
    out = torch.cat(pieces)
    assert out.numel() == full.numel()
    assert (out - full).abs().max().item() <= TOL
