"""Cross-request batching over real sockets: several client processes, random arrival, backpressure,
and a stalled stream that must not hold up the others."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from conftest import TINY, start_sidecar
from test_server_e2e import _metric

TOL = 1e-5
WORKER = Path(__file__).with_name("client_worker.py")


PIPELINED = "scheduler:\n  max_steps_in_flight: 2\n"  # (auto is 1 on the CPU: here the pipelined stepper's logic)


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_streams_from_several_processes_equal_decoding_alone(tmp_path, golden_cases, steps_in_flight):
    running = start_sidecar(tmp_path) if steps_in_flight == 1 else _start_with_config(tmp_path, PIPELINED)
    try:
        procs = []
        for p in range(3):
            out = tmp_path / f"proc{p}.npz"
            cmd = [sys.executable, str(WORKER), running.address, str(TINY / "cases.safetensors"), f"p{p}", "4",
                   str(p), str(out)]
            procs.append((subprocess.Popen(cmd), out))
        for proc, _ in procs:
            assert proc.wait(timeout=120) == 0
        full = golden_cases["full"][:, 0].numpy()
        checked = 0
        for _, out in procs:
            for name, audio in np.load(out).items():
                row = int(name[3])
                assert audio.shape == full[row].shape
                assert np.abs(audio - full[row]).max() <= TOL, name
                checked += 1
        assert checked == 12
        text = running.scrape()
        batches = _metric(text, "code2wav_sidecar_batch_size_count")
        chunks = _metric(text, "code2wav_sidecar_batch_size_sum")
        assert chunks / batches > 1.0  # chunks of different streams and processes shared forwards
        overlapped = _metric(text, "code2wav_sidecar_steps_overlapped_total")
        assert overlapped == 0 if steps_in_flight == 1 else overlapped > 0, overlapped
    finally:
        running.stop()


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_pipelined_chunks_keep_per_stream_order(tmp_path, golden_cases, steps_in_flight):
    """Ten chunks of a stream in flight at once: with two steps in flight a stream's next chunk still waits for
    the step that holds its previous one (its state), so the audio is exact."""
    sidecar = start_sidecar(tmp_path) if steps_in_flight == 1 else _start_with_config(tmp_path, PIPELINED)
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    try:
        with SidecarClient(sidecar.address, timeout_s=30) as client:
            a, b = client.open_stream("a"), client.open_stream("b")
            fa = [a.submit(codes[0, :, s:s + 4], final=(s == 36)) for s in range(0, 40, 4)]  # ten in flight at once
            fb = [b.submit(codes[1, :, s:s + 8], final=(s == 32)) for s in range(0, 40, 8)]
            out_a = torch.cat([f.result(30) for f in fa])
            out_b = torch.cat([f.result(30) for f in fb])
    finally:
        sidecar.stop()
    assert (out_a - full[0]).abs().max().item() <= TOL
    assert (out_b - full[1]).abs().max().item() <= TOL


def _start_with_config(tmp_path, config_text: str):
    config = tmp_path / "sidecar.yaml"
    config.write_text(config_text)
    return start_sidecar(tmp_path, "--config", str(config))


def test_full_queue_answers_busy_at_once_and_recovers(tmp_path, golden_cases):
    running = _start_with_config(tmp_path, "scheduler:\n  max_pending_chunks: 3\n  max_batch_size: 2\n")
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    try:
        with SidecarClient(running.address, timeout_s=30) as client:
            streams = [client.open_stream(f"s{i}") for i in range(12)]
            t0 = time.monotonic()
            outs = client.decode_batch([(s, codes[i % 2, :, :20]) for i, s in enumerate(streams)],
                                       return_exceptions=True)
            busy = [i for i, o in enumerate(outs) if isinstance(o, cerr.Busy)]
            assert 0 < len(busy) < 12 and all(isinstance(o, (torch.Tensor, cerr.Busy)) for o in outs)
            assert time.monotonic() - t0 < 20
            for i in busy:  # a busy chunk was not applied: the same seq goes through later
                outs[i] = streams[i].decode(codes[i % 2, :, :20])
            for i, s in enumerate(streams):
                rest = s.decode(codes[i % 2, :, 20:], final=True)
                assert (torch.cat([outs[i], rest]) - full[i % 2]).abs().max().item() <= TOL
            assert _metric(running.scrape(), "code2wav_sidecar_errors_total", code="busy") == len(busy)
    finally:
        running.stop()


def test_stalled_stream_and_unread_replies_do_not_block_others(sidecar, golden_cases):
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    with SidecarClient(sidecar.address, timeout_s=30) as slow_client, SidecarClient(sidecar.address) as client:
        stalled = slow_client.open_stream("stalled")
        stalled.decode(codes[0, :, :5])  # then it sends nothing for a while
        unread = [stalled.submit(codes[0, :, 5 + i:6 + i]) for i in range(3)]  # replies nobody waits for yet
        t0 = time.monotonic()
        s = client.open_stream("busy-bee")
        pieces = [s.decode(codes[1, :, i:i + 5], final=(i == 35)) for i in range(0, 40, 5)]
        assert time.monotonic() - t0 < 20
        assert (torch.cat(pieces) - full[1]).abs().max().item() <= TOL
        assert all(f.result(30).numel() == 48 for f in unread)


def test_batching_window_waits_only_while_an_open_stream_can_still_join(tmp_path, golden_cases):
    """The window (here a minute, longer than any timeout below) is skipped when every open stream has a chunk
    queued: a lone stream's chunk runs at once, and so does a pair once the second chunk is there."""
    running = _start_with_config(tmp_path, "scheduler:\n  batch_window_us: 60000000\n")
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    try:
        with SidecarClient(running.address, timeout_s=20) as client:
            a = client.open_stream("a")
            first_a = a.decode(codes[0, :, :10])  # alone: no waiting for company (else a timeout)
            b = client.open_stream("b")
            pending_a = a.submit(codes[0, :, 10:20])  # b is open and idle: this chunk waits for it
            time.sleep(1.0)
            assert not pending_a.done()
            first_b = b.decode(codes[1, :, :20])  # now both streams have a chunk queued: they run together
            second_a = pending_a.result(20)
            last_b = b.submit(codes[1, :, 20:], final=True)  # b's last chunk waits for a (open, idle) ...
            time.sleep(1.0)
            assert not last_b.done()
            last_a = a.decode(codes[0, :, 20:30])  # ... until a sends
            last_b = last_b.result(20)
            last_a = torch.cat([last_a, a.decode(codes[0, :, 30:], final=True)])  # b closed: a alone again
        assert (torch.cat([first_a, second_a, last_a]) - full[0]).abs().max().item() <= TOL
        assert (torch.cat([first_b, last_b]) - full[1]).abs().max().item() <= TOL
        text = running.scrape()
        assert _metric(text, "code2wav_sidecar_batch_size_sum") == 6  # a, a+b, a+b, a: 4 steps, 6 chunks
        assert _metric(text, "code2wav_sidecar_batch_size_count") == 4
    finally:
        running.stop()
