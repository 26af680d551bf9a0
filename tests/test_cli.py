"""The command line: offline decode (exact and window) against the golden vectors, demo, bench smoke test,
config errors that name the offending key, decode input errors (one line each, exit 2), keygen's refusal to
overwrite, the server key given to demo/bench, --help defaults and --version."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import wave

import numpy as np
import pytest

from conftest import ROOT, TINY

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, timeout_s: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "code2wav.sidecar", *args], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, cwd=ROOT, timeout=timeout_s)


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
    assert proc.returncode == 2 and "values span [99, 99]; expected [B, 4, T]" in proc.stderr
    assert "values in [0, 64)" in proc.stderr


def test_demo_streams_through_a_spawned_sidecar(tmp_path):
    out = tmp_path / "demo.wav"
    proc = run_cli("demo", "--model", str(TINY), "--device", "cpu", "--frames", "51", "--output", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "latency_ms" in proc.stdout and "ready:" in proc.stdout
    assert "sidecar log: " in proc.stdout  # where the spawned server's log went
    with wave.open(str(out)) as f:
        assert f.getnframes() == 51 * 48
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(ln.split()[1]) for ln in lines] == [1, 25, 25]  # vLLM-Omni chunking: 1 frame, then 25


def test_bench_smoke_writes_json_and_plot(tmp_path):
    report_path, plot_path, temp = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "tmp"
    temp.mkdir()
    proc = run_cli("bench", "--model", str(TINY), "--device", "cpu", "--concurrency", "1,4", "--frames", "26",
                   "--baseline-iters", "3", "--baseline", "none", "--json", str(report_path), "--plot", str(plot_path),
                   timeout_s=300, env={"TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(report_path.read_text())
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"]
    assert {b["name"] for b in report["baselines"]} >= {"window-eager-b1", "exact-eager-b1"}
    rows = {r["concurrency"]: r for r in report["results"]}
    assert set(rows) == {1, 4}
    for r in rows.values():
        # closed loop: at least --min-streams (4 by default on the CPU) streams per level, in turn per slot; 1 + 25
        # frames each
        assert r["errors"] == 0 and r["streams"] == 4 and r["chunks"] == 4 * 2
        assert r["chunk_latency_ms_p50"] > 0 and r["audio_s_per_s"] > 0 and r["mean_batch_size"] >= 1
    assert plot_path.stat().st_size > 10_000
    assert "through the sidecar" in proc.stdout and "sidecar log: " in proc.stdout
    assert [p.name for p in temp.iterdir() if p.name.startswith("code2wav-")] == []  # the spawned sidecar's temp
    # folder was removed at exit (torch may keep its own caches there)


def test_serve_rejects_unknown_config_key(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("graphs:\n  bucket: [1]\n")
    proc = run_cli("serve", "--config", str(config), timeout_s=60)
    assert proc.returncode == 2
    assert "unknown key 'graphs.bucket'" in proc.stderr


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_decode_input_and_output_errors_are_one_line_each(tmp_path, codes_npy):
    def decode(input_path, output_path) -> str:
        return _one_error_line(run_cli("decode", "--model", str(TINY), "--device", "cpu", "--input",
                                       str(input_path), "--output", str(output_path)))

    out = tmp_path / "out.wav"
    assert "the folder " in decode(codes_npy, tmp_path / "no" / "out.wav") and "does not exist" in \
        decode(codes_npy, tmp_path / "no" / "out.wav")
    assert "use a .npy (float32 [B, 1, T*U]) or .wav" in decode(codes_npy, tmp_path / "out.mp3")
    assert not list(tmp_path.glob("out*"))  # refused before decoding: nothing written
    assert "no such file (expected integer codes [B, Q, T]" in decode(tmp_path / "missing.npy", out)
    garbage = tmp_path / "garbage.npy"
    garbage.write_text("not numpy")
    assert "not a readable .npy array" in decode(garbage, out)
    pickled = tmp_path / "pickled.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert "not a readable .npy array" in decode(pickled, out)  # never unpickled
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros((1, 4, 3), dtype=np.float32))
    assert "dtype float32; expected integer codes [B, Q, T]" in decode(floats, out)
    flat = tmp_path / "flat.npy"
    np.save(flat, np.zeros((12,), dtype=np.int64))
    assert "shape [12]; expected integer codes [B, Q, T] or [Q, T]" in decode(flat, out)
    wrong_q = tmp_path / "wrong_q.npy"
    np.save(wrong_q, np.zeros((1, 3, 5), dtype=np.int64))
    assert "shape [1, 3, 5]; expected [B, 4, T] with B, T >= 1 and values in [0, 64)" in decode(wrong_q, out)
    negative = tmp_path / "negative.npy"
    np.save(negative, np.full((1, 4, 2), -1, dtype=np.int32))
    assert "values span [-1, -1]; expected [B, 4, T]" in decode(negative, out)
    assert not out.exists()


def test_keygen_refuses_to_overwrite_without_force(tmp_path):
    keys = tmp_path / "keys"
    first = run_cli("keygen", str(keys), timeout_s=60)
    assert first.returncode == 0, first.stderr
    public = (keys / "server.key").read_bytes()
    line = _one_error_line(run_cli("keygen", str(keys), timeout_s=60))
    assert "already exist" in line and "--force" in line
    assert (keys / "server.key").read_bytes() == public  # untouched
    forced = run_cli("keygen", str(keys), "--force", timeout_s=60)
    assert forced.returncode == 0, forced.stderr
    assert (keys / "server.key").read_bytes() != public  # a new pair


def test_server_key_rule_file_or_z85(tmp_path):
    import zmq
    import zmq.auth

    from code2wav.client.errors import InvalidArgument
    from code2wav.client.keys import server_public_key

    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "server")
    public, _ = zmq.auth.load_certificate(public_file)
    assert server_public_key(public_file) == public
    assert server_public_key(secret_file) == public  # the secret file holds the public key too
    assert server_public_key(public.decode()) == public
    assert server_public_key(public) == public
    other, _ = zmq.curve_keypair()
    assert server_public_key(other.decode()) == other
    for bad in ("nonsense", "x" * 39, "\x7f" * 40, str(tmp_path / "missing.key")):
        with pytest.raises(InvalidArgument, match="neither an existing certificate file nor a 40-character"):
            server_public_key(bad)
    not_cert = tmp_path / "not_cert.key"
    not_cert.write_text("hello")
    with pytest.raises(InvalidArgument, match="not a ZeroMQ certificate"):
        server_public_key(not_cert)


def test_demo_takes_the_server_key_like_the_client(tmp_path):
    from code2wav.loadgen.spawn import spawn_sidecar

    keys = tmp_path / "keys"
    assert run_cli("keygen", str(keys), timeout_s=60).returncode == 0
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    refused = run_cli("demo", "--address", f"tcp://127.0.0.1:{port}", "--server-key", "nonsense")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr  # argparse's usage error, at start
    assert "error: argument --server-key: server key 'nonsense' is neither an existing certificate file" in \
        refused.stderr
    running = spawn_sidecar("--model", str(TINY), "--device", "cpu", "--address", f"tcp://0.0.0.0:{port}",
                            "--curve-secret-key-file", str(keys / "server.key_secret"), workdir=tmp_path)
    try:
        out = tmp_path / "demo.wav"
        proc = run_cli("demo", "--address", f"tcp://127.0.0.1:{port}", "--server-key", str(keys / "server.key"),
                       "--frames", "26", "--output", str(out))
        assert proc.returncode == 0, proc.stderr + proc.stdout
        with wave.open(str(out)) as f:
            assert f.getnframes() == 26 * 48
    finally:
        running.stop()


def _option_entries(help_text: str) -> dict[str, str]:
    """``--option`` -> its help text, from an argparse ``--help`` output."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        stripped = line.strip()
        if line.startswith("  -") or line.startswith("  --"):
            current = stripped.split()[0].rstrip(",")
            entries[current] = stripped
        elif current is not None and line.startswith("   ") and stripped:
            entries[current] += " " + stripped
        elif not stripped or not line.startswith(" "):
            current = None
    return entries


@pytest.mark.parametrize("command", ["serve", "decode", "keygen", "demo", "bench"])
def test_help_shows_a_default_for_every_option(command):
    proc = run_cli(command, "--help", timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    entries = _option_entries(proc.stdout)
    assert len(entries) >= 2, proc.stdout
    missing = [opt for opt, text in entries.items()
               if opt not in ("-h", "--help", "--input", "--output") and "default:" not in text]
    assert missing == [], f"{command} --help: no default shown for {missing}"
    if command in ("serve", "decode"):
        dtype = entries["--dtype"]
        assert "float32 (exact to the golden vectors)" in dtype and "bfloat16" in dtype and "float16" in dtype


def test_version():
    proc = run_cli("--version", timeout_s=60)
    assert proc.returncode == 0
    assert re.fullmatch(r"code2wav-sidecar \S+ \(wire protocol v\d+\)", proc.stdout.strip()), proc.stdout
