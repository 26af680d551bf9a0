"""A bounded soak: random stream lengths, aborts, abandoned streams and client restarts against one sidecar.
Zero unexpected errors, every finished stream exact, active streams and arena back to zero, memory flat.

CI runs it for ~45 s on CPU (CODE2WAV_SOAK_S); run it longer on the GPU machine (graphs and all) with
`CODE2WAV_SOAK_S=600 CODE2WAV_SOAK_DEVICE=cuda python -m pytest tests/test_soak.py -s`.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from code2wav.client import SidecarClient
from conftest import start_sidecar
from test_liveness import _wait_for
from test_server_e2e import _metric

SOAK_S = float(os.environ.get("CODE2WAV_SOAK_S", "45"))
SOAK_DEVICE = os.environ.get("CODE2WAV_SOAK_DEVICE", "cpu")


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _worker(address: str, codes: torch.Tensor, full: torch.Tensor, seed: int, stop_at: float, stats: dict,
            errors: list) -> None:
    rng = random.Random(seed)
    spf = 48
    while time.monotonic() < stop_at:
        try:
            with SidecarClient(address, timeout_s=30) as client:  # a client restart every loop
                for n in range(rng.randint(1, 6)):
                    row = rng.randint(0, 1)
                    length = rng.randint(1, 40)
                    stream = client.open_stream(f"w{seed}-{stats['streams']}-{n}")
                    stats["streams"] += 1
                    pos, pieces, fate = 0, [], rng.random()
                    while pos < length:
                        size = 1 if pos == 0 else rng.randint(1, 25)
                        end = min(length, pos + size)
                        if fate < 0.1 and pos > 0:
                            stream.abort()
                            stats["aborted"] += 1
                            break
                        if fate > 0.9 and pos > 0 and end < length:
                            stats["abandoned"] += 1  # left open: freed by the client's bye or the TTL
                            break
                        pieces.append(stream.decode(codes[row, :, pos:end], final=(end == length)))
                        stats["chunks"] += 1
                        pos = end
                    else:
                        audio = torch.cat(pieces)
                        if (audio - full[row, : length * spf]).abs().max().item() > 1e-5:
                            errors.append(f"stream of {length} frames differs from the one-shot decode")
                        stats["finished"] += 1
        except Exception as exc:  # noqa: BLE001 - every error is unexpected here
            errors.append(f"{type(exc).__name__}: {exc}")
            return


@pytest.mark.slow
def test_soak(tmp_path, golden_cases):
    running = start_sidecar(tmp_path, "--stream-ttl-s", "1.5", "--max-streams", "48", "--device", SOAK_DEVICE)
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    try:
        stats = {"streams": 0, "chunks": 0, "aborted": 0, "abandoned": 0, "finished": 0}
        errors: list[str] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=_worker, args=(running.address, codes, full, seed, t0 + SOAK_S, stats,
                                                          errors)) for seed in range(4)]
        for t in threads:
            t.start()
        # after warm-up, counted in work done, not seconds: on a loaded box 10 s may be only the first few chunks
        # (allocator arenas and caches still growing), which reads as a leak later
        warm_until = time.monotonic() + SOAK_S / 2
        while (stats["chunks"] < 300 or time.monotonic() < t0 + min(10.0, SOAK_S / 3)) and \
                time.monotonic() < warm_until:
            time.sleep(0.2)
        rss_early = _rss_bytes(running.proc.pid)
        for t in threads:
            t.join(SOAK_S + 120)
        assert not errors, errors[:5]
        assert stats["finished"] > 20 and stats["aborted"] > 0 and stats["abandoned"] > 0, stats
        assert _wait_for(lambda: _metric(running.scrape(), "code2wav_sidecar_active_streams") == 0, 10)
        text = running.scrape()
        assert _metric(text, "code2wav_sidecar_arena_slots", kind="used") == 0
        freed_unfinished = sum(_metric(text, "code2wav_sidecar_streams_closed_total", reason=r) for r in ("ttl", "bye"))
        assert freed_unfinished >= stats["abandoned"]  # abandoned streams: freed by the client's bye or the TTL
        rss_late = _rss_bytes(running.proc.pid)
        print(f"soak {SOAK_S:.0f}s: {stats}; sidecar RSS {rss_early / 2**20:.1f} -> {rss_late / 2**20:.1f} MiB")
        assert rss_late - rss_early < 40 * 2**20  # flat: no per-stream or per-client leak
    finally:
        running.stop()
