"""The command line: offline decode (exact and window) against the golden vectors, demo, bench smoke test,
and config errors that name the offending key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave

import numpy as np
import pytest

from conftest import ROOT, TINY

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "code2wav.sidecar", *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=timeout_s)


@pytest.fixture(scope="module")
def codes_npy(tmp_path_factory, golden_cases):
    path = tmp_path_factory.mktemp("codes") / "codes.npy"
    np.save(path, golden_cases["codes"].numpy())
    return path


def test_decode_exact_and_window_match_golden(tmp_path, codes_npy, golden_cases):
    out = tmp_path / "full.npy"
    proc = run_cli("decode", "--model", str(TINY), "--input", str(codes_npy), "--output", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    full = np.load(out)
    assert full.shape == (2, 1, 1920) and full.dtype == np.float32
    assert np.abs(full - golden_cases["full"].numpy()).max() <= 1e-5  # exact is the default mode
    out = tmp_path / "chunked.npy"
    proc = run_cli("decode", "--model", str(TINY), "--input", str(codes_npy), "--output", str(out), "--device", "cpu",
                   "--mode", "window", "--chunk-frames", "12", "--left-context-frames", "5", "--time")
    assert proc.returncode == 0, proc.stderr
    assert "decode time:" in proc.stdout
    assert np.abs(np.load(out) - golden_cases["chunked"].numpy()).max() <= 1e-5


def test_decode_writes_wav_and_rejects_bad_codes(tmp_path, codes_npy):
    out = tmp_path / "out.wav"
    proc = run_cli("decode", "--model", str(TINY), "--input", str(codes_npy), "--output", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    for b in range(2):  # two rows -> out-0.wav, out-1.wav
        with wave.open(str(tmp_path / f"out-{b}.wav")) as f:
            assert f.getframerate() == 24000 and f.getnframes() == 1920 and f.getsampwidth() == 2
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full((1, 4, 3), 99, dtype=np.int64))
    proc = run_cli("decode", "--model", str(TINY), "--input", str(bad), "--output", str(out), "--device", "cpu")
    assert proc.returncode == 2 and "values in [0, 64)" in proc.stderr


def test_demo_streams_through_a_spawned_sidecar(tmp_path):
    out = tmp_path / "demo.wav"
    proc = run_cli("demo", "--model", str(TINY), "--device", "cpu", "--frames", "51", "--output", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "latency_ms" in proc.stdout and "ready:" in proc.stdout
    with wave.open(str(out)) as f:
        assert f.getnframes() == 51 * 48
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(ln.split()[1]) for ln in lines] == [1, 25, 25]  # vLLM-Omni chunking: 1 frame, then 25


def test_bench_smoke_writes_json_and_plot(tmp_path):
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_cli("bench", "--model", str(TINY), "--device", "cpu", "--concurrency", "1,4", "--frames", "26",
                   "--baseline-iters", "3", "--json", str(report_path), "--plot", str(plot_path), timeout_s=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(report_path.read_text())
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"]
    assert {b["name"] for b in report["baselines"]} >= {"window-eager-b1", "exact-eager-b1"}
    rows = {r["concurrency"]: r for r in report["results"]}
    assert set(rows) == {1, 4}
    for r in rows.values():
        assert r["errors"] == 0 and r["chunks"] == r["concurrency"] * 2  # 1 + 25 frames per stream
        assert r["chunk_latency_ms_p50"] > 0 and r["audio_s_per_s"] > 0 and r["mean_batch_size"] >= 1
    assert plot_path.stat().st_size > 10_000
    assert "through the sidecar" in proc.stdout


def test_serve_rejects_unknown_config_key(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("graphs:\n  bucket: [1]\n")
    proc = run_cli("serve", "--config", str(config), timeout_s=60)
    assert proc.returncode == 2
    assert "unknown key 'graphs.bucket'" in proc.stderr
