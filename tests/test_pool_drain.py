"""Loss-free drain across a pool (issue 48): a rolling restart of all three sidecars under load loses no stream.

Each sidecar runs with ``drain_grace_s``; on SIGTERM it refuses new streams, says ``draining`` in its ``pong`` and
keeps serving its open streams; the pool moves each of them to another sidecar at a chunk boundary (history
replay) and aborts it on the old one, which exits (0) as soon as none is open, well before the grace runs out.
90 streams of both modes decode without pause meanwhile; every stream's audio equals the decoder's own reference
(one-shot for exact, the window decode for window) within the exact tolerance, and no stream sees an error.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from code2wav.client import SidecarPool, StreamLost
from code2wav.sidecar.models import load_model
from code2wav.sidecar.modes import get_mode
from code2wav.sidecar.offline import decode_offline
from conftest import TINY
from test_pool import TOL, _start

NUM_STREAMS = 90
CHUNK_FRAMES = 4
MAX_CHUNKS = 200  # per stream; the load stops two rounds after the last restart
LEFT_CONTEXT_FRAMES = 25  # the pool's default for window streams
GRACE_S = 20.0


def _config(tmp_path) -> str:
    path = tmp_path / "drain.yaml"
    path.write_text(f"drain_grace_s: {GRACE_S}\n")
    return str(path)


def _reference(codes: torch.Tensor, num_frames: int) -> dict[str, torch.Tensor]:
    """Exact rows (even): the one-shot decode; window rows (odd): the window decode of the same chunks."""
    model = load_model(str(TINY), torch.device("cpu"), "float32")
    inputs = codes[:, :, :num_frames]  # [S, Q, T]
    exact = model.forward(inputs[0::2])[:, 0]  # [S/2, T * U]
    window = decode_offline(model, inputs[1::2], get_mode("window"), CHUNK_FRAMES, LEFT_CONTEXT_FRAMES)[:, 0]
    return {f"s{n}": (exact[n // 2] if n % 2 == 0 else window[n // 2]) for n in range(codes.shape[0])}


def test_a_rolling_restart_of_every_sidecar_under_load_loses_no_stream(tmp_path):
    config = _config(tmp_path)
    running = [_start(tmp_path / f"s{index}", 40, "--config", config) for index in range(3)]
    gen = torch.Generator().manual_seed(48)
    codes = torch.randint(0, 64, (NUM_STREAMS, 4, MAX_CHUNKS * CHUNK_FRAMES), generator=gen)  # [S, Q, T]
    pool = SidecarPool([sidecar.address for sidecar in running], timeout_s=30)
    restarts: list[dict] = []
    restarted = threading.Event()

    def roll() -> None:
        try:
            for index in range(3):
                old = running[index]
                started = time.monotonic()
                old.proc.send_signal(signal.SIGTERM)
                code = old.proc.wait(timeout=GRACE_S + 30)
                exited_s = time.monotonic() - started
                log_text = old.log()  # (before the new process writes its own in the same folder)
                running[index] = _start(tmp_path / f"s{index}", 40, "--config", config)  # same address, new epoch
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not any(
                        m["address"] == old.address and m["answering"] for m in pool.members):
                    time.sleep(0.05)
                restarts.append({"code": code, "exited_s": exited_s, "log": log_text})
        finally:
            restarted.set()

    try:
        streams = {f"s{n}": pool.open_stream(f"s{n}", mode="exact" if n % 2 == 0 else "window")
                   for n in range(NUM_STREAMS)}
        audio: dict[str, list[torch.Tensor]] = {name: [] for name in streams}
        roller = threading.Thread(target=roll)
        roller.start()
        rounds_after = 0
        num_chunks = 0
        while num_chunks < MAX_CHUNKS and rounds_after < 2:
            rounds_after += restarted.is_set()
            futures = {name: stream.submit(codes[int(name[1:]), :, num_chunks * CHUNK_FRAMES:
                                                 (num_chunks + 1) * CHUNK_FRAMES])
                       for name, stream in streams.items()}
            wait(list(futures.values()), timeout=120)
            for name, future in futures.items():
                audio[name].append(future.result())  # no stream sees an error
            num_chunks += 1
        roller.join(120)
        assert restarted.is_set() and len(restarts) == 3, restarts
        assert num_chunks < MAX_CHUNKS  # the load outlasted the restarts

        for restart in restarts:
            assert restart["code"] == 0
            assert restart["exited_s"] < GRACE_S  # every stream moved away: no need to wait out the grace
            assert "drain grace over after" in restart["log"] and " 0 of " in restart["log"]
        stats = pool.failover_stats()
        assert stats["streams_lost"] == 0 and stats["failovers"] == 0, stats
        assert stats["drain_moves"] >= NUM_STREAMS  # each stream moved at least once (one sidecar, then another)
        reference = _reference(codes, num_chunks * CHUNK_FRAMES)
        for name in streams:
            got = torch.cat(audio[name])
            assert got.numel() == num_chunks * CHUNK_FRAMES * 48
            assert (got - reference[name]).abs().max().item() <= TOL, name
    finally:
        pool.close()
        for sidecar in running:
            sidecar.stop()


def test_a_drain_with_nowhere_to_move_keeps_serving_until_the_grace_ends(tmp_path):
    """A pool of one: the draining sidecar's stream has nowhere to go, so it stays and is still served through the
    grace (not lost early); when the grace ends the sidecar drains and exits, and the stream ends with
    ``StreamLost``."""
    path = tmp_path / "short.yaml"
    path.write_text("drain_grace_s: 3\n")
    sidecar = _start(tmp_path / "only", 4, "--config", str(path))
    codes = torch.randint(0, 64, (4, 40), generator=torch.Generator().manual_seed(1))  # [Q, T]
    pool = SidecarPool(sidecar.address, timeout_s=30, failover_open_timeout_s=1.0)
    try:
        stream = pool.open_stream("s0")
        stream.decode(codes[:, :4])
        sidecar.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        time.sleep(1.0)  # the pool saw it draining by now, and found nowhere to move the stream
        assert stream.decode(codes[:, 4:8]).numel() == 4 * 48  # still served during the grace
        assert sidecar.proc.wait(timeout=30) == 0
        assert 3.0 <= time.monotonic() - started
        assert "1 of 1 streams still open" in sidecar.log()
        with pytest.raises(StreamLost):
            stream.decode(codes[:, 8:12])
        assert pool.failover_stats()["streams_lost"] == 1 and pool.failover_stats()["drain_moves"] == 0
    finally:
        pool.close()
        sidecar.stop()
