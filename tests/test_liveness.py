"""Liveness both ways: dead clients are cleaned up, a dead or restarted sidecar is noticed quickly with typed
errors, and SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from conftest import ROOT, TINY, start_sidecar
from code2wav.loadgen.spawn import spawn_sidecar
from test_server_e2e import _metric

KILLED_CLIENT = """
import sys, time, torch
sys.path.insert(0, {root!r})
from code2wav.client import SidecarClient
c = SidecarClient({address!r})
for i in range(3):
    s = c.open_stream(f"doomed-{{i}}")
    s.decode(torch.zeros(4, 3, dtype=torch.long))
print("ready", flush=True)
time.sleep(60)
"""


def _wait_for(predicate, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def _kill_a_client_with_three_streams(running) -> float:
    """Start a client process that opens 3 streams, SIGKILL it (no bye); returns the seconds until the sidecar
    has no active stream (at most 8)."""
    code = KILLED_CLIENT.format(root=str(ROOT), address=running.address)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert _metric(running.scrape(), "code2wav_sidecar_active_streams") == 3
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    assert _wait_for(lambda: _metric(running.scrape(), "code2wav_sidecar_active_streams") == 0, 8)
    return time.monotonic() - t0


def test_sigkilled_client_streams_are_freed_within_ttl(tmp_path):
    running = start_sidecar(tmp_path, "--stream-ttl-s", "1")
    try:
        assert _kill_a_client_with_three_streams(running) < 3.5  # ttl 1 s + reaper period
        text = running.scrape()
        # each stream is freed idle past the TTL, or with its client, silent past min(client_silence_s, ttl_s):
        # the client was last heard at its last chunk's arrival, a few ms before that stream's last activity (the
        # chunk's reply), so a reaper tick can fall between the two and free the last stream with its client
        ttl = _metric(text, "code2wav_sidecar_streams_closed_total", reason="ttl")
        silent = _metric(text, "code2wav_sidecar_streams_closed_total", reason="silent")
        assert ttl + silent == 3 and ttl >= 2, (ttl, silent)
        assert _metric(text, "code2wav_sidecar_arena_slots", kind="used") == 0
    finally:
        running.stop()


def test_sidecar_death_and_restart_are_noticed(tmp_path, golden_cases):
    codes = golden_cases["codes"][0]
    workdir = tmp_path / "w"
    workdir.mkdir()
    args = ("--model", str(TINY), "--device", "cpu", "--max-streams", "8")
    first = spawn_sidecar(*args, workdir=workdir)
    client = SidecarClient(first.address, timeout_s=30)
    try:
        old = client.open_stream("old")
        old.decode(codes[:, :5])
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        t0 = time.monotonic()
        with pytest.raises((cerr.Unavailable, cerr.StreamLost)):
            old.decode(codes[:, 5:10])  # noticed by heartbeats, not after the 30 s timeout
        assert time.monotonic() - t0 < 3.0
        second = spawn_sidecar(*args, workdir=workdir)  # same address, new boot epoch
        try:
            def new_stream_works():
                try:
                    return client.open_stream("new").decode(codes[:, :5]).numel() == 5 * 48
                except (cerr.Unavailable, cerr.StreamLost):
                    return False
            assert _wait_for(new_stream_works, 10, 0.2)
            with pytest.raises(cerr.StreamLost):
                old.decode(codes[:, 5:10])  # streams of the old epoch are gone, and say so
        finally:
            second.stop()
    finally:
        client.close()


def test_sigterm_drains_in_flight_chunks_and_exits_zero(tmp_path, golden_cases):
    """Chunks the sidecar accepted before SIGTERM complete (bit-exact), later requests get a typed error, exit 0.

    No sleep decides what is in flight: a batching window of 10 minutes holds every chunk in the sidecar's queue
    (one stream sends: one chunk per batch, and the batch never fills; a second stream stays open and idle, so the
    window waits for its company), the test waits until the sidecar's own queue_depth gauge shows all of them, and
    only then sends SIGTERM; the drain runs them without the window."""
    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]
    num_chunks = 8
    config = tmp_path / "held.yaml"
    config.write_text("scheduler:\n  max_batch_size: 64\n  batch_window_us: 600000000\n")
    running = start_sidecar(tmp_path, "--config", str(config))
    try:
        with SidecarClient(running.address, timeout_s=60) as client:
            s = client.open_stream("drain")
            client.open_stream("company")  # open and idle: it could join a batch, so the window holds the others
            futures = [s.submit(codes[:, a:a + 5]) for a in range(0, 5 * num_chunks, 5)]
            queued = _wait_for(lambda: _metric(running.scrape(), "code2wav_sidecar_queue_depth") == num_chunks, 60)
            assert queued, "the sidecar never showed the chunks in its queue"
            assert not any(f.done() for f in futures)  # held by the window: in flight at the signal
            running.proc.send_signal(signal.SIGTERM)
            outs = [f.result(60) for f in futures]  # every accepted chunk completes, none is lost or refused
            got = torch.cat(outs)
            assert got.numel() == 5 * num_chunks * 48
            assert (got - full[: got.numel()]).abs().max().item() <= 1e-5
            with pytest.raises((cerr.Unavailable, cerr.SidecarError)):
                client.open_stream("late", timeout_s=3)
        assert running.proc.wait(timeout=60) == 0
    finally:
        running.stop()  # (after a failure above: no sidecar left behind)
    log_text = running.log()
    assert "Traceback" not in log_text
    assert f"shutdown: drained {num_chunks} chunks" in log_text and f"served {num_chunks} chunks" in log_text


def test_a_silent_clients_streams_are_freed_before_their_ttl(tmp_path):
    """``streams.client_silence_s``: a SIGKILLed client (no heartbeat) loses its streams after that silence, long
    before the streams' TTL, so a killed client's state does not pile up for the TTL (issue 22's soak)."""
    config = tmp_path / "sidecar.yaml"
    config.write_text("streams: {ttl_s: 600, client_silence_s: 2}\n")
    running = start_sidecar(tmp_path, "--config", str(config))
    try:
        assert _kill_a_client_with_three_streams(running) < 4.5  # 2 s of silence + the reaper's period (0.5 s)
        text = running.scrape()
        assert _metric(text, "code2wav_sidecar_streams_closed_total", reason="silent") == 3
        assert _metric(text, "code2wav_sidecar_arena_slots", kind="used") == 0
    finally:
        running.stop()


def test_client_silence_must_outlast_the_heartbeats(tmp_path):
    from code2wav.sidecar.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("heartbeat_interval_s: 1.0\nstreams: {client_silence_s: 2}\n")
    with pytest.raises(ValueError, match=r"streams.client_silence_s \(2\) must be at least 4 x heartbeat_interval_s"):
        load_config(path)


def test_an_armed_wait_may_not_outlast_a_heartbeat_interval(tmp_path):
    from code2wav.sidecar.config import armed_wait_s, load_config

    path = tmp_path / "c.yaml"
    path.write_text("heartbeat_interval_s: 0.5\narmed_wait_s: 0.6\n")
    with pytest.raises(ValueError, match=r"armed_wait_s \(0.6\) must be at most heartbeat_interval_s \(0.5\)"):
        load_config(path)
    path.write_text("heartbeat_interval_s: 0.5\narmed_wait_s: 0.5\n")
    assert armed_wait_s(load_config(path)) == 0.5
    path.write_text("heartbeat_interval_s: 0.1\nstreams: {client_silence_s: 1}\n")  # the default wait, 0.25 s
    assert armed_wait_s(load_config(path)) == 0.1
    assert armed_wait_s(load_config()) == 0.25


STOPPED_CLIENT = """
import sys, time, torch
sys.path.insert(0, {root!r})
from code2wav.client import SidecarClient
c = SidecarClient({address!r})
s = c.open_stream("paused")
s.decode(torch.zeros(4, 3, dtype=torch.long))
print("ready", flush=True)
sys.stdin.readline()  # the test SIGSTOPs this process here, then SIGCONTs it and writes a line
time.sleep(1.5)  # the heartbeat goes out, is refused, and the client says hello again
try:
    s.decode(torch.zeros(4, 3, dtype=torch.long))
    print("old stream: decoded", flush=True)
except Exception as exc:
    print("old stream: " + type(exc).__name__, flush=True)
t = c.open_stream("after")
print("new stream: " + str(t.decode(torch.zeros(4, 3, dtype=torch.long)).numel()), flush=True)
"""


def _silence_config(tmp_path, silence_s: float):
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"streams: {{ttl_s: 600, client_silence_s: {silence_s}}}\n")
    return start_sidecar(tmp_path, "--config", str(config))


def test_an_idle_live_client_keeps_its_streams_past_the_silence(tmp_path):
    """The client's heartbeat counts as hearing from it: an idle client is never taken for a silent one."""
    running = _silence_config(tmp_path, 2)
    try:
        with SidecarClient(running.address) as client:
            stream = client.open_stream("idle")
            stream.decode(torch.zeros(4, 3, dtype=torch.long))
            time.sleep(5)  # 2.5 x client_silence_s without a chunk: only pings
            assert stream.decode(torch.zeros(4, 3, dtype=torch.long)).numel() > 0
        assert _metric(running.scrape(), "code2wav_sidecar_streams_closed_total", reason="silent") == 0
    finally:
        running.stop()


def test_a_client_back_from_a_long_stop_gets_stream_lost(tmp_path):
    """A client the server dropped for its silence (here SIGSTOPped past it) learns so from its refused ping:
    its old stream fails with ``StreamLost`` (not ``not_found``), and it can open new streams at once."""
    running = _silence_config(tmp_path, 2)
    try:
        code = STOPPED_CLIENT.format(root=str(ROOT), address=running.address)
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGSTOP)
        assert _wait_for(lambda: _metric(running.scrape(), "code2wav_sidecar_active_streams") == 0, 8)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=60)
        assert "old stream: StreamLost" in out, out
        assert "new stream: " in out and not out.strip().endswith("new stream: 0"), out
        assert _metric(running.scrape(), "code2wav_sidecar_streams_closed_total", reason="silent") == 1
    finally:
        running.stop()
