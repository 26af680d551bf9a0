"""Shutdown and signals on a real sidecar process over real ZeroMQ (issue 47, items 1 and 4).

- SIGTERM and SIGINT drain, and every reply the sidecar owes still reaches a slow reader: multi-MiB
  ``decode_result``s queued in the socket at the signal arrive whole (the socket stays open after the drain until
  they are sent, up to ``shutdown_timeout_s``), then the process exits 0.
- What is still queued when ``shutdown_timeout_s`` runs out is dropped with a warning, and the process exits 0.
- A second SIGTERM during the shutdown exits at once (143).
- SIGHUP without CurveZMQ is ignored with a log line (it used to kill the process); with CurveZMQ it reloads the
  allow-list (tests/test_session_owner.py).
- A step loop that dies (an error it does not contain) stops the sidecar, with exit code 1, instead of leaving one
  that answers pings and decodes nothing (an in-process server: the error is injected into its stepper).

The slow reader is a raw DEALER that takes one message at a time (``RCVHWM`` 1, a small kernel buffer) and sleeps
between messages, so the replies wait in the sidecar's socket when the signal comes. Large replies cost no decode:
after one real decode, resending a stream's last seq is answered with the kept audio again (section 5 of
proto/README.md), byte for byte.
"""

from __future__ import annotations

import signal
import time
import uuid

import msgpack
import numpy as np
import pytest
import zmq

from code2wav import proto
from code2wav.client import SidecarClient
from conftest import VOXCPM2_TINY, start_sidecar
from test_liveness import _wait_for

NUM_STREAMS = 4
NUM_FRAMES = 512  # VoxCPM2 tiny: 240 samples a frame, so 480 KiB of audio per chunk, ~1.9 MiB per reply
LATENT_CHANNELS = 16
NUM_RESENDS = 5


def _reader(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # one message at a time: the rest waits on the sidecar's side
    sock.setsockopt(zmq.RCVBUF, 64 * 1024)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.setsockopt(zmq.ROUTING_ID, b"slow-" + uuid.uuid4().bytes)
    sock.connect(address)
    return sock


def _ask(sock: zmq.Socket, header: dict) -> proto.ServerMessage:
    sock.send(msgpack.packb(header))
    return proto.decode_server_message(sock.recv_multipart())


def _send_decode(sock: zmq.Socket, request_id: int, seq: int, latents: list[np.ndarray]) -> None:
    chunks = [{"stream_id": f"s{i}", "seq": seq,
               "codes": {"dtype": "float32", "shape": list(x.shape), "loc": "inline", "frame": i + 1}}
              for i, x in enumerate(latents)]
    sock.send_multipart([msgpack.packb({"type": "decode", "request_id": request_id, "chunks": chunks}),
                         *[x.tobytes() for x in latents]])


def _receive(sock: zmq.Socket) -> tuple[proto.DecodeResult, list[bytes]]:
    frames = sock.recv_multipart()
    reply = proto.decode_server_message(frames)
    assert isinstance(reply, proto.DecodeResult), reply
    return reply, frames[1:]


def _prepare(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, list[bytes]]:
    """A reader with NUM_STREAMS streams that each decoded one chunk; returns it and each stream's audio bytes."""
    sock = _reader(ctx, address)
    assert isinstance(_ask(sock, {"type": "hello", "request_id": 1, "version": 1, "client_id": "slow-reader"}),
                      proto.Welcome)
    for i in range(NUM_STREAMS):
        assert isinstance(_ask(sock, {"type": "open_stream", "request_id": 2 + i, "stream_id": f"s{i}"}),
                          proto.Opened)
    rng = np.random.default_rng(47)
    latents = [rng.standard_normal((LATENT_CHANNELS, NUM_FRAMES), dtype=np.float32) for _ in range(NUM_STREAMS)]
    _send_decode(sock, 10, 0, latents)
    reply, audio = _receive(sock)
    assert [r.error for r in reply.results] == [None] * NUM_STREAMS
    assert [len(a) for a in audio] == [NUM_FRAMES * 240 * 4] * NUM_STREAMS
    return sock, audio


def _queue_resends(sock: zmq.Socket) -> None:
    """NUM_RESENDS replies of ~1.9 MiB each, answered at once from the kept audio: they queue in the socket."""
    for k in range(NUM_RESENDS):
        _send_decode(sock, 100 + k, 0, [np.zeros((LATENT_CHANNELS, NUM_FRAMES), np.float32)] * NUM_STREAMS)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_every_owed_reply_reaches_a_slow_reader_after_the_signal(tmp_path, sig):
    running = start_sidecar(tmp_path, model=str(VOXCPM2_TINY))
    ctx = zmq.Context()
    try:
        sock, reference = _prepare(ctx, running.address)
        _queue_resends(sock)
        rng = np.random.default_rng(1)
        fresh = [rng.standard_normal((LATENT_CHANNELS, 64), dtype=np.float32) for _ in range(NUM_STREAMS)]
        _send_decode(sock, 200, 1, fresh)  # a new chunk per stream: decoding or queued at the signal
        time.sleep(0.3)  # (the sidecar has read them by now; their replies wait behind the resends')
        running.proc.send_signal(sig)
        got = {}
        while len(got) < NUM_RESENDS + 1:
            time.sleep(0.25)  # a slow reader: ~8 MiB/s
            reply, audio = _receive(sock)
            got[reply.request_id] = (reply, audio)
        assert sorted(got) == [*range(100, 100 + NUM_RESENDS), 200]
        for k in range(NUM_RESENDS):
            reply, audio = got[100 + k]
            assert [r.error for r in reply.results] == [None] * NUM_STREAMS
            assert audio == reference  # every byte, as first sent
        reply, audio = got[200]
        for result in reply.results:  # decoded in the drain, or refused if the signal came first: a reply either way
            assert result.error is None or result.error.code == "unavailable"
        assert sum(map(len, audio)) == sum(64 * 240 * 4 for r in reply.results if r.error is None)
        assert running.proc.wait(timeout=60) == 0
        log_text = running.log()
        assert "every queued reply was sent" in log_text and "Traceback" not in log_text
        assert f"{sig.name}: draining" in log_text
    finally:
        ctx.destroy(linger=0)
        running.stop()


def _config(tmp_path, shutdown_timeout_s: float) -> str:
    path = tmp_path / "shutdown.yaml"
    path.write_text(f"shutdown_timeout_s: {shutdown_timeout_s}\n")
    return str(path)


def test_replies_still_queued_after_the_shutdown_timeout_are_dropped_and_logged(tmp_path):
    running = start_sidecar(tmp_path, "--config", _config(tmp_path, 1.0), model=str(VOXCPM2_TINY))
    ctx = zmq.Context()
    try:
        sock, _ = _prepare(ctx, running.address)
        _queue_resends(sock)  # never read
        time.sleep(0.3)
        started = time.monotonic()
        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 15  # bounded by the timeout, not by the reader
        log_text = running.log()
        assert "replies were still queued after shutdown_timeout_s (1s) and were dropped" in log_text
        assert "every queued reply was sent" not in log_text
    finally:
        ctx.destroy(linger=0)
        running.stop()


def test_a_second_sigterm_during_the_shutdown_exits_at_once(tmp_path):
    running = start_sidecar(tmp_path, "--config", _config(tmp_path, 600.0), model=str(VOXCPM2_TINY))
    ctx = zmq.Context()
    try:
        sock, _ = _prepare(ctx, running.address)
        _queue_resends(sock)  # never read: the shutdown would wait up to 600 s for them
        time.sleep(0.3)
        running.proc.send_signal(signal.SIGTERM)
        assert _wait_for(lambda: "shutdown: drained" in running.log(), 30)
        time.sleep(0.5)
        assert running.proc.poll() is None  # waiting for the reader
        started = time.monotonic()
        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 5
        assert "SIGTERM again during the shutdown: exiting now" in running.log()
    finally:
        ctx.destroy(linger=0)
        running.stop()


def test_sighup_without_curve_is_ignored_with_a_log_line(sidecar):
    with SidecarClient(sidecar.address, timeout_s=30) as client:
        stream = client.open_stream("kept")
        info = client.server_info.models[0]
        codes = np.arange(info.num_quantizers * 6, dtype=np.int64).reshape(info.num_quantizers, 6) % 7
        before = stream.decode(codes[:, :3])
        sidecar.proc.send_signal(signal.SIGHUP)
        assert _wait_for(lambda: "SIGHUP ignored: nothing to reload" in sidecar.log(), 10)
        after = stream.decode(codes[:, 3:])  # the same stream goes on
        assert before.numel() == after.numel() == 3 * info.samples_per_frame
    assert sidecar.proc.poll() is None
    sidecar.proc.send_signal(signal.SIGTERM)
    assert sidecar.proc.wait(timeout=60) == 0


def test_a_step_loop_that_dies_stops_the_sidecar(tmp_path, caplog):
    from code2wav.sidecar.config import load_config
    from conftest import TINY
    from test_family_toy import InProcessServer

    async def dies() -> None:
        raise RuntimeError("injected: the step loop's own bug")

    def break_step_loop(server) -> None:
        server.stepper.run = dies

    cfg = load_config(None, {"address": f"ipc://{tmp_path}/s.sock", "model": str(TINY), "device": "cpu",
                             "metrics_port": 0})
    with caplog.at_level("CRITICAL", logger="code2wav.sidecar.server"):
        running = InProcessServer(cfg, prepare=break_step_loop)
        running._thread.join(30)  # serve() returns on its own: nobody called stop()
    assert not running._thread.is_alive(), "the sidecar kept running without a step loop"
    server = running.server
    assert isinstance(server.step_loop_error, RuntimeError) and not server.ready
    assert any("the step loop died (RuntimeError: injected" in r.getMessage() for r in caplog.records)
