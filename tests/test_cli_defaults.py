"""What the commands do by default, per device and per model family (issue 43, items 3, 4, 5, 7):

- bfloat16 on a CPU without native bfloat16 is warned about at start, with the probe's measured slowdown;
- ``bench`` on the CPU defaults to a short run; ``demo`` and ``bench`` leave no temp folder behind;
- ``demo`` and ``decode`` follow the family's chunking (VoxCPM2: 4-frame patches) and take ``[Q, T]`` codes;
- ``--metrics-port 0`` puts the port it got in the ready line; ``--version`` is the installed package's.
Real subprocesses and servers, the tiny golden models, CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
import wave
from importlib.metadata import version

import numpy as np

from conftest import ROOT, TINY, VOXCPM2_TINY, start_sidecar

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
ENV.pop("CODE2WAV_SIDECAR_ADDRESS", None)
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}  # an x86 CPU without native bfloat16


def run_cli(*args: str, env: dict | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "code2wav.sidecar", *args], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, cwd=ROOT, timeout=timeout_s)


def test_bfloat16_on_a_cpu_without_native_bfloat16_is_warned_with_the_measured_cost(tmp_path, golden_cases):
    codes = tmp_path / "codes.npy"
    np.save(codes, golden_cases["codes"][:1, :, :8].numpy())
    proc = run_cli("decode", "--model", str(TINY), "--device", "cpu", "--dtype", "bfloat16", "--input", str(codes),
                   "--output", str(tmp_path / "o.npy"), env=AVX2_ONLY)
    assert proc.returncode == 0, proc.stderr
    (warning,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    ratio = int(re.search(r"a conv probe at start-up ran (\d+)x slower than float32", warning).group(1))
    assert ratio >= 5 and "use --dtype float32 on the CPU" in warning  # (27-45x measured on this path, one thread)
    quiet = run_cli("decode", "--model", str(TINY), "--device", "cpu", "--input", str(codes), "--output",
                    str(tmp_path / "f.npy"), env=AVX2_ONLY)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr  # float32: nothing to say


def test_the_dtype_probe_leaves_torchs_thread_pool_as_it_was():
    import torch

    from code2wav.sidecar.cpu_dtype import cpu_dtype_warning, cpu_slowdown

    threads = torch.get_num_threads()
    assert cpu_slowdown("bfloat16") > 0 and torch.get_num_threads() == threads
    assert cpu_dtype_warning("cpu", "float32") is None and cpu_dtype_warning("cuda", "bfloat16") is None


def test_bench_on_the_cpu_defaults_to_a_short_run(tmp_path):
    report_path = tmp_path / "b.json"
    proc = run_cli("bench", "--device", "cpu", "--model", str(TINY), "--no-sidecar", "--no-baselines", "--json",
                   str(report_path))
    assert proc.returncode == 0, proc.stderr
    settings = json.loads(report_path.read_text())["settings"]
    assert (settings["concurrency"], settings["frames"], settings["min_streams"], settings["baseline_iters"],
            settings["baseline_warmup"]) == \
        ("1,4", 26, 4, 2, 1)
    given = run_cli("bench", "--device", "cpu", "--model", str(TINY), "--no-sidecar", "--no-baselines",
                    "--concurrency", "2", "--frames", "51", "--json", str(report_path))
    assert given.returncode == 0, given.stderr
    settings = json.loads(report_path.read_text())["settings"]
    assert (settings["concurrency"], settings["frames"]) == ("2", 51)  # a flag given wins


def test_demo_follows_the_latents_familys_patches_and_removes_its_temp_folder(tmp_path):
    temp, out = tmp_path / "tmp", tmp_path / "demo.wav"
    temp.mkdir()
    proc = run_cli("demo", "--model", str(VOXCPM2_TINY), "--device", "cpu", "--frames", "24", "--output", str(out),
                   env={"TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    sizes = [int(ln.split()[1]) for ln in proc.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert sizes == [4] * 6  # VoxCPM2's talker: one 4-frame patch per step (not 1 + 25)
    with wave.open(str(out)) as f:
        assert f.getnframes() == 24 * 240 and f.getframerate() == 48000  # the tiny model: 240 samples per frame
    assert [p.name for p in temp.iterdir() if p.name.startswith("code2wav-")] == []  # the spawned sidecar's socket
    # and log folder went with it (torch may keep its own caches there)


def test_decode_takes_q_by_t_codes_like_the_client(tmp_path, golden_cases):
    one = tmp_path / "one.npy"
    np.save(one, golden_cases["codes"][0].numpy())  # [Q, T]: one stream, as the client takes it
    proc = run_cli("decode", "--model", str(TINY), "--device", "cpu", "--input", str(one), "--output",
                   str(tmp_path / "o.npy"))
    assert proc.returncode == 0, proc.stderr
    wav = np.load(tmp_path / "o.npy")
    assert wav.shape == (1, 1, 1920)
    assert np.abs(wav[0] - golden_cases["full"][0].numpy()).max() <= 1e-5


def test_decode_window_defaults_are_the_familys(tmp_path):
    latents = tmp_path / "lat.npy"
    np.save(latents, np.random.default_rng(0).standard_normal((1, 16, 24)).astype(np.float32))
    outputs = {}
    for name, extra in (("default", []), ("explicit", ["--chunk-frames", "4", "--left-context-frames", "20"]),
                        ("other", ["--chunk-frames", "8", "--left-context-frames", "4"])):
        out = tmp_path / f"{name}.npy"
        proc = run_cli("decode", "--model", str(VOXCPM2_TINY), "--device", "cpu", "--mode", "window", "--input",
                       str(latents), "--output", str(out), *extra)
        assert proc.returncode == 0, proc.stderr
        outputs[name] = np.load(out)
    assert "chunks of 8 after 4" in proc.stdout
    assert np.array_equal(outputs["default"], outputs["explicit"])  # 4-frame patches after 20 frames of history
    assert np.abs(outputs["default"] - outputs["other"]).max() > 1e-3  # (the sizes matter: the check can fail)


def test_metrics_port_0_puts_the_port_it_got_in_the_ready_line(tmp_path):
    running = start_sidecar(tmp_path)  # `serve --metrics-port 0`
    try:
        port = int(re.search(r"metrics=http://127\.0\.0\.1:(\d+)/metrics", running.ready_line).group(1))
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert b"code2wav" in resp.read()
    finally:
        running.stop()


def test_version_is_the_installed_package_version():
    proc = run_cli("--version", timeout_s=60)
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"code2wav-sidecar {version('code2wav-sidecar')} (wire protocol v")
