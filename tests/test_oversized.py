"""Messages over the limits (issue 22, item 4). The server answers a message over ``max_message_bytes`` with
``invalid_argument`` naming the limit; a single frame over libzmq's hard cap (ZMQ_MAXMSGSIZE = 2 x
max_message_bytes + 1 MiB) makes libzmq drop that connection with no reply (protocol section 8), and the server
keeps serving everyone else. The client checks its own messages against the welcome's limits before sending and
raises ``LimitExceeded`` naming the limit."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

from code2wav import proto
from code2wav.client import LimitExceeded, SidecarClient
from code2wav.client._call import Call
from conftest import start_sidecar
from test_server_e2e import RawPeer

MAX_MESSAGE_BYTES = 65536
HARD_CAP_BYTES = 2 * MAX_MESSAGE_BYTES + (1 << 20)  # transport.py's ZMQ_MAXMSGSIZE


@pytest.fixture
def small_sidecar(tmp_path):
    config = tmp_path / "limits.yaml"
    config.write_text(f"limits:\n  max_message_bytes: {MAX_MESSAGE_BYTES}\n")
    running = start_sidecar(tmp_path, "--config", str(config))
    yield running
    running.stop()


def test_exceeded_limit_names_the_limit():
    limits = proto.Limits(max_message_bytes=100, max_header_bytes=50, max_frames_per_message=3)
    head = msgpack.packb({"type": "ping", "request_id": 1})
    assert proto.exceeded_limit([head, b"x" * 50], limits) is None
    assert proto.exceeded_limit([head, b"x" * 90], limits)[0] == "max_message_bytes"
    assert proto.exceeded_limit([b"h" * 60], limits)[0] == "max_header_bytes"
    name, message = proto.exceeded_limit([head, b"", b"", b""], limits)
    assert name == "max_frames_per_message" and "4 frames" in message and "max_frames_per_message" in message


def test_server_answers_over_limit_and_drops_over_hard_cap(small_sidecar):
    peer = RawPeer(small_sidecar.address)
    other = RawPeer(small_sidecar.address)
    try:
        assert peer.hello().limits.max_message_bytes == MAX_MESSAGE_BYTES
        other.hello()
        peer.send({"type": "ping", "request_id": 5}, b"x" * (MAX_MESSAGE_BYTES + 1))  # over the limit: answered
        reply = peer.recv()
        assert isinstance(reply, proto.Error) and reply.code == proto.ErrorCode.INVALID_ARGUMENT
        assert reply.request_id == 5 and "max_message_bytes" in reply.message
        peer.send({"type": "ping", "request_id": 6}, b"x" * (HARD_CAP_BYTES + 1))  # over libzmq's cap: dropped
        peer.sock.setsockopt(zmq.RCVTIMEO, 1500)
        with pytest.raises(zmq.Again):
            peer.recv()
        other.send(proto.Ping(7))  # everyone else is still served
        assert isinstance(other.recv(), proto.Pong)
        assert small_sidecar.proc.poll() is None
    finally:
        peer.close()
        other.close()


def test_client_refuses_to_send_over_the_servers_limits(small_sidecar, golden_cases):
    with SidecarClient(small_sidecar.address) as client:
        stream = client.open_stream("s")
        codes = golden_cases["codes"][0]  # [Q, T]
        frames_fit = MAX_MESSAGE_BYTES // (codes.shape[0] * 8)
        big = codes[:, :1].repeat(1, frames_fit + 1)  # [Q, n]: just over max_message_bytes as int64
        with pytest.raises(LimitExceeded) as info:
            stream.decode(big)
        assert info.value.limit == "max_message_bytes" and "max_message_bytes" in str(info.value)
        with pytest.raises(LimitExceeded) as info:
            stream.decode(torch.zeros(codes.shape[0], client.limits.max_chunk_frames + 1, dtype=torch.long))
        assert info.value.limit == "max_chunk_frames"
        failures = []  # any message, checked where the connection sends: nothing leaves
        call = Call(99, [msgpack.packb({"type": "ping", "request_id": 99}), b"x" * MAX_MESSAGE_BYTES], 5.0,
                    lambda msg, frames: None, lambda error, outcome: failures.append((error, outcome)))
        client._conn.submit(call)  # noqa: SLF001
        assert len(failures) == 1 and isinstance(failures[0][0], LimitExceeded)
        assert failures[0][0].limit == "max_message_bytes" and failures[0][1] == "not_sent"
        assert stream.decode(codes[:, :3]).numel() == 3 * 48  # the stream is untouched
