"""``code2wav-sidecar decode`` with float latents for a VoxCPM2 model folder: output against the golden, the
``--sr-cond`` option, ``[D, T]`` input, and errors that say what to change (real subprocesses, no mocks)."""

from __future__ import annotations

import os
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden" / "voxcpm2_tiny_a"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
TOL = 1e-5


def run_cli(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "code2wav.sidecar", *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=timeout_s)


@pytest.fixture(scope="module")
def cases() -> dict[str, np.ndarray]:
    return load_file(str(GOLDEN / "cases.safetensors"))


@pytest.fixture(scope="module")
def latents_npy(tmp_path_factory, cases) -> Path:
    path = tmp_path_factory.mktemp("latents") / "latents.npy"
    np.save(path, cases["latents"])
    return path


def test_decode_latents_matches_golden(tmp_path, latents_npy, cases):
    out = tmp_path / "out.npy"
    proc = run_cli("decode", "--model", str(GOLDEN), "--input", str(latents_npy), "--output", str(out),
                   "--device", "cpu", "--time")
    assert proc.returncode == 0, proc.stderr
    assert "sr_cond=48000)" in proc.stdout and "decode time:" in proc.stdout  # the option at its default
    assert np.abs(np.load(out) - cases["full"]).max() <= TOL


def test_decode_latents_sr_cond_and_single_stream(tmp_path, cases):
    one = tmp_path / "one.npy"
    np.save(one, cases["latents"][0])  # [D, T]: one stream
    out = tmp_path / "out.npy"
    proc = run_cli("decode", "--model", str(GOLDEN), "--input", str(one), "--output", str(out), "--device", "cpu",
                   "--sr-cond", "16000")
    assert proc.returncode == 0, proc.stderr
    assert "sr_cond=16000" in proc.stdout
    assert np.abs(np.load(out)[0] - cases["full_sr_cond"][0]).max() <= TOL  # row 0 of the golden is 16000 Hz
    wav_out = tmp_path / "out.wav"
    proc = run_cli("decode", "--model", str(GOLDEN), "--input", str(one), "--output", str(wav_out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    with wave.open(str(wav_out)) as f:
        assert f.getframerate() == 48000 and f.getnframes() == 57 * 240


def test_decode_latents_errors(tmp_path, cases):
    out = tmp_path / "out.npy"
    for name, array, expected in (
            ("codes.npy", np.zeros((1, 16, 4), dtype=np.int64), "dtype int64; expected float latents [B, D, T]"),
            ("shape.npy", np.zeros((1, 8, 4), dtype=np.float32), "expected latents [B, 16, T] or [16, T]"),
            ("nan.npy", np.full((16, 4), np.nan, dtype=np.float32), "non-finite value (NaN or inf)")):
        np.save(tmp_path / name, array)
        proc = run_cli("decode", "--model", str(GOLDEN), "--input", str(tmp_path / name), "--output", str(out),
                       "--device", "cpu")
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    np.save(tmp_path / "ok.npy", cases["latents"])
    proc = run_cli("decode", "--model", "default", "--input", str(tmp_path / "ok.npy"), "--output", str(out),
                   "--sr-cond", "16000")
    assert proc.returncode == 2 and "dtype float32; expected integer codes" in proc.stderr  # latents to a codes model
    codes = tmp_path / "codes.npy"
    np.save(codes, np.zeros((1, 16, 4), dtype=np.int64))
    proc = run_cli("decode", "--model", "default", "--input", str(codes), "--output", str(out), "--sr-cond", "16000")
    assert proc.returncode == 2 and "unknown stream option(s) ['sr_cond']; this model takes none" in proc.stderr
    proc = run_cli("decode", "--model", str(GOLDEN), "--input", str(tmp_path / "ok.npy"), "--output", str(out),
                   "--device", "cpu", "--sr-cond", "0")
    assert proc.returncode == 2 and "stream option 'sr_cond' must be an integer in [1, 192000], got 0" in proc.stderr
