"""``bench --address a,b``: a pool's levels report each sidecar's figures beside the totals (real sidecars, real
bench process); the per-sidecar figures add up to the totals and match what the sidecars themselves counted."""

from __future__ import annotations

import json
import subprocess

from conftest import start_sidecar
from test_bench_cli import BENCH, ENV, ROOT
from test_server_e2e import _metric


def test_bench_over_a_pool_reports_each_sidecar_and_the_total(tmp_path):
    running = []
    try:
        for index in range(2):
            (tmp_path / f"s{index}").mkdir()
            running.append(start_sidecar(tmp_path / f"s{index}"))
        report_path = tmp_path / "pool.json"
        address = ",".join(sidecar.address for sidecar in running)
        proc = subprocess.run([*BENCH, "--no-baselines", "--address", address, "--concurrency", "4", "--frames", "26",
                               "--min-streams", "8", "--clients", "2", "--json", str(report_path)],
                              capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (level,) = json.loads(report_path.read_text())["results"]
        parts = level["sidecars"]
        assert set(parts) == {sidecar.address for sidecar in running}
        assert all(part["streams"] > 0 for part in parts.values())  # both took streams
        for key in ("streams", "chunks"):
            assert sum(part[key] for part in parts.values()) == level[key], key
        total = sum(part["audio_s_per_s"] for part in parts.values())
        assert abs(total - level["audio_s_per_s"]) <= 2e-3 * level["audio_s_per_s"]  # each rounded to 4 digits
        warmup_chunks = 2 * 2  # one warm-up stream per client connection, two chunks each (1 + 25 frames)
        decoded = [_metric(sidecar.scrape(), "code2wav_sidecar_batch_size_sum") for sidecar in running]
        assert sum(decoded) == level["chunks"] + warmup_chunks
        for sidecar in running:
            assert sidecar.address in proc.stdout  # the table's per-sidecar lines
    finally:
        for sidecar in running:
            sidecar.stop()
