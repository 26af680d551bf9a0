"""Every command answers a bad option or input with one line: the real ``code2wav-sidecar`` (or ``python -m
code2wav.loadgen.soak``) in a subprocess, one case per row: exit code 2, exactly one stderr line (``error: ...``
naming the option and what is accepted), no traceback, nothing written into the case's output folder, and a
timeout per case that turns a hang into a failure. Cases that need a server use one module server (the VoxCPM2
tiny model: latents, 4-frame patches). Inputs that cannot be weights (a truncated safetensors file, a Git LFS
pointer, another architecture's checkpoint, a checkpoint root) are built here in a temp folder."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY, VOXCPM2_TINY, start_sidecar

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
ENV.pop("CODE2WAV_SIDECAR_ADDRESS", None)
CASE_TIMEOUT_S = 90  # a hang (demo --chunk-frames 0 looped forever) fails the case instead of the run
CLI = [sys.executable, "-m", "code2wav.sidecar"]
SOAK = [sys.executable, "-m", "code2wav.loadgen.soak"]
ON_CPU = ["--device", "cpu"]
SERVE = ["serve", "--address", "ipc://{out}/sock/s.sock", "--metrics-port", "0", "--log-level", "error", *ON_CPU]
DECODE = ["decode", *ON_CPU, "--model", str(TINY), "--input", "{data}/codes.npy", "--output", "{out}/o.npy"]
VOX_DECODE = ["decode", *ON_CPU, "--model", str(VOXCPM2_TINY), "--input", "{data}/latents.npy",
              "--output", "{out}/o.npy"]
DEMO = ["demo", *ON_CPU, "--model", str(TINY), "--output", "{out}/d.wav"]
BENCH = ["bench", *ON_CPU, "--model", str(TINY), "--json", "{out}/b.json"]
PROFILE = ["profile", *ON_CPU, "--model", str(TINY), "--json", "{out}/p.json"]
FIDELITY = ["fidelity", *ON_CPU, "--model", str(TINY), "--json", "{out}/f.json"]
NO_CUDA = not torch.cuda.is_available()

# (case id, command, argv, words the one error line holds); "{out}" is the case's own (empty) output folder,
# "{data}" the module's inputs, "{live}" the module server's address, "{busy_port}" a TCP port held open
CASES = [
    ("no command", CLI, [], "the following arguments are required: COMMAND"),
    ("unknown command", CLI, ["bogus"], "invalid choice: 'bogus'"),
    # serve
    ("serve device gpu", CLI, [*SERVE, "--device", "gpu"], "argument --device: 'gpu' is not a device; use auto | cpu"),
    ("serve dtype", CLI, [*SERVE, "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    ("serve metrics port range", CLI, [*SERVE, "--metrics-port", "70000"], "--metrics-port: expected a port in 0..65535"),
    ("serve metrics port negative", CLI, [*SERVE, "--metrics-port", "-1"], "--metrics-port: expected an integer >= 0"),
    ("serve metrics port in use", CLI, [*SERVE, "--metrics-port", "{busy_port}"],
     "--metrics-port {busy_port}: metrics port {busy_port} on 127.0.0.1 is not available"),
    ("serve max streams 0", CLI, [*SERVE, "--max-streams", "0"], "--max-streams: expected an integer >= 1, got '0'"),
    ("serve ttl 0", CLI, [*SERVE, "--stream-ttl-s", "0"], "--stream-ttl-s: expected a number > 0"),
    ("serve ttl nan", CLI, [*SERVE, "--stream-ttl-s", "nan"], "--stream-ttl-s: expected a number > 0, got 'nan'"),
    ("serve address without scheme", CLI, [*SERVE, "--address", "/tmp/x.sock"], "--address: '/tmp/x.sock' has no scheme"),
    ("serve address of a live sidecar", CLI, [*SERVE, "--address", "{live}"], "address in use"),
    ("serve missing model folder", CLI, [*SERVE, "--model", "{out}/missing"], "--model {out}/missing: no such folder"),
    ("serve checkpoint root", CLI, [*SERVE, "--model", "{data}/root"],
     "--model {data}/root is a checkpoint root (its config.json is the TTS model's); give its decoder folder: "
     "--model {data}/root/speech_tokenizer"),
    ("serve lfs pointer", CLI, [*SERVE, "--model", "{data}/lfs"], "is a Git LFS pointer"),
    ("serve missing config", CLI, [*SERVE, "--config", "{out}/none.yaml"], "--config: {out}/none.yaml: no such file"),
    ("serve unknown config key", CLI, [*SERVE, "--config", "{data}/bad.yaml"], "unknown key 'graphs.bucket'"),
    ("serve curve key with ipc", CLI, [*SERVE, "--curve-secret-key-file", "{data}/keys/server.key_secret"],
     "--curve-secret-key-file (security.curve_secret_key_file) is for tcp:// addresses"),
    ("serve log level", CLI, [*SERVE, "--log-level", "loud"], "--log-level loud: choose one of debug, info"),
    # decode
    ("decode negative left context", CLI, [*DECODE, "--mode", "window", "--left-context-frames", "-3"],
     "--left-context-frames: expected an integer >= 0, got '-3'"),
    ("decode chunk 0", CLI, [*DECODE, "--mode", "window", "--chunk-frames", "0"], "--chunk-frames: expected an integer >= 1"),
    ("decode chunk -5", CLI, [*DECODE, "--mode", "window", "--chunk-frames", "-5"], "--chunk-frames: expected an integer >= 1"),
    ("decode output suffix", CLI, [*DECODE, "--output", "{out}/o.mp3"], "use a .npy (float32 [B, 1, T*U]) or .wav"),
    ("decode output folder", CLI, [*DECODE, "--output", "{out}/no/o.wav"], "the folder {out}/no does not exist"),
    ("decode missing input", CLI, [*DECODE, "--input", "{out}/none.npy"], "--input {out}/none.npy: no such file"),
    ("decode garbage input", CLI, [*DECODE, "--input", "{data}/garbage.npy"], "not a readable .npy array"),
    ("decode float16 latents", CLI, [*VOX_DECODE, "--input", "{data}/latents16.npy"],
     "dtype float16 is not accepted (nor by the client)"),
    ("decode codes for a latents model", CLI, [*VOX_DECODE, "--input", "{data}/codes.npy"],
     "dtype int64; expected float latents"),
    ("decode latents chunk not a patch", CLI, [*VOX_DECODE, "--mode", "window", "--chunk-frames", "25"],
     "--chunk-frames 25: this model (voxcpm2_audiovae) takes whole 4-frame patches"),
    ("decode sr_cond range", CLI, [*VOX_DECODE, "--sr-cond", "0"], "stream option 'sr_cond' must be an integer in"),
    ("decode device gpu", CLI, [*DECODE, "--device", "gpu"], "--device: 'gpu' is not a device"),
    ("decode truncated safetensors", CLI, [*DECODE, "--model", "{data}/truncated"], "truncated"),
    ("decode lfs pointer", CLI, [*DECODE, "--model", "{data}/lfs"], "git lfs pull"),
    ("decode wrong architecture", CLI, [*DECODE, "--model", "{data}/wrongarch"], "does not match the decoder config"),
    ("decode checkpoint root", CLI, [*DECODE, "--model", "{data}/root"], "--model {data}/root/speech_tokenizer"),
    ("decode unknown family", CLI, [*DECODE, "--model", "{data}/whisper"], "is no known decoder family"),
    ("decode without input", CLI, ["decode", "--output", "{out}/o.npy"], "the following arguments are required: --input"),
    # keygen
    ("keygen into a file", CLI, ["keygen", "{data}/garbage.npy"], "is a file; give a folder"),
    ("keygen without folder", CLI, ["keygen"], "the following arguments are required: directory"),
    # demo
    ("demo chunk 0", CLI, [*DEMO, "--chunk-frames", "0"], "--chunk-frames: expected an integer >= 1, got '0'"),
    ("demo frames 0", CLI, [*DEMO, "--frames", "0"], "--frames: expected an integer >= 1, got '0'"),
    ("demo first chunk 0", CLI, [*DEMO, "--first-chunk-frames", "0"], "--first-chunk-frames: expected an integer >= 1"),
    ("demo output folder", CLI, [*DEMO, "--output", "{out}/no/x.wav"], "the folder {out}/no does not exist"),
    ("demo output suffix", CLI, [*DEMO, "--output", "{out}/x.mp3"], "--output: {out}/x.mp3: use a file name ending in .wav"),
    ("demo device gpu", CLI, [*DEMO, "--device", "gpu"], "--device: 'gpu' is not a device"),
    ("demo address without scheme", CLI, [*DEMO, "--address", "localhost:5555"], "has no scheme"),
    ("demo server key", CLI, [*DEMO, "--server-key", "nonsense"], "--server-key: server key 'nonsense' is neither"),
    ("demo missing model", CLI, [*DEMO, "--model", "{out}/missing"], "--model {out}/missing: no such folder"),
    ("demo latents chunk not a patch", CLI, [*DEMO, "--model", str(VOXCPM2_TINY), "--chunk-frames", "25"],
     "--chunk-frames 25: this model (voxcpm2_audiovae) takes whole 4-frame patches"),
    ("demo live latents chunk not a patch", CLI, ["demo", "--address", "{live}", "--output", "{out}/d.wav",
                                                   "--first-chunk-frames", "1"], "--first-chunk-frames 1: this model"),
    ("demo live frames not a patch", CLI, ["demo", "--address", "{live}", "--output", "{out}/d.wav", "--frames", "10"],
     "--frames 10: this model (voxcpm2_audiovae) takes whole 4-frame patches"),
    ("demo sidecar fails to start", CLI, [*DEMO, "--model", "{data}/lfs"],
     "the sidecar did not start (exit code 2):"),
    # bench
    ("bench concurrency 0", CLI, [*BENCH, "--concurrency", "0"], "--concurrency: expected comma-separated integers >= 1"),
    ("bench concurrency words", CLI, [*BENCH, "--concurrency", "a,b"], "--concurrency: expected comma-separated"),
    ("bench frames 0", CLI, [*BENCH, "--frames", "0"], "--frames: expected an integer >= 1"),
    ("bench chunk 0", CLI, [*BENCH, "--chunk-frames", "0"], "--chunk-frames: expected an integer >= 1"),
    ("bench json folder", CLI, [*BENCH, "--json", "{out}/no/b.json"], "--json: {out}/no/b.json: the folder"),
    ("bench plot suffix", CLI, [*BENCH, "--plot", "{out}/b.txt"], "--plot: {out}/b.txt: use a file name ending in .png"),
    ("bench device gpu", CLI, [*BENCH, "--device", "gpu"], "--device: 'gpu' is not a device"),
    ("bench warmup negative", CLI, [*BENCH, "--baseline-warmup", "-1"], "--baseline-warmup: expected an integer >= 0"),
    ("bench replot missing", CLI, [*BENCH, "--replot", "{out}/none.json"], "--replot: {out}/none.json: no such file"),
    ("bench missing model", CLI, [*BENCH, "--model", "{out}/missing"], "--model {out}/missing: no such folder"),
    ("bench metrics url", CLI, [*BENCH, "--metrics-url", "localhost:9464"], "--metrics-url: 'localhost:9464': give"),
    ("bench unknown scenario", CLI, [*BENCH, "--scenario", "nosuch"], "nosuch"),
    # profile
    ("profile batch 0", CLI, [*PROFILE, "--batch", "0"], "--batch: expected an integer >= 1, got '0'"),
    ("profile top -1", CLI, [*PROFILE, "--top", "-1"], "--top: expected an integer >= 0 (0: all)"),
    ("profile device gpu", CLI, [*PROFILE, "--device", "gpu"], "--device: 'gpu' is not a device"),
    ("profile json folder", CLI, [*PROFILE, "--json", "{out}/no/p.json"], "the folder {out}/no does not exist"),
    ("profile missing model", CLI, [*PROFILE, "--model", "{out}/missing"], "--model {out}/missing: no such folder"),
    # fidelity
    ("fidelity paths", CLI, [*FIDELITY, "--paths", "exact,foo"], "--paths: 'exact,foo': choose comma-separated"),
    ("fidelity frames 0", CLI, [*FIDELITY, "--frames", "0"], "--frames: expected an integer >= 1"),
    ("fidelity missing model", CLI, [*FIDELITY, "--model", "{out}/missing"], "--model {out}/missing: no such folder"),
    ("fidelity latents model", CLI, [*FIDELITY, "--model", str(VOXCPM2_TINY), "--paths", "exact"],
     "fidelity compares Qwen3-TTS codes paths"),
    # soak (a developer tool, same rules)
    ("soak clients 0", SOAK, ["--clients", "0", "--streams-per-client", "1"], "--clients: expected an integer >= 1"),
    ("soak no stream count", SOAK, ["--device", "cpu"], "give --streams-per-client, or --capacity-streams"),
]
NO_VLLM_OMNI_CASES = [
    ("fidelity stock without vllm-omni", CLI, [*FIDELITY, "--paths", "stock,exact"],
     "--paths stock (a default) needs vllm-omni, which is not installed: pip install vllm-omni==0.30.0"),
]
CPU_ONLY_CASES = [
    ("serve cuda without a GPU", CLI, [*SERVE, "--device", "cuda"], "CUDA is not available on this machine"),
    ("decode cuda:3 without a GPU", CLI, [*DECODE, "--device", "cuda:3"], "CUDA is not available on this machine"),
    ("demo cuda without a GPU", CLI, [*DEMO, "--device", "cuda"], "CUDA is not available on this machine"),
]


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The cases' inputs: arrays, configs, keys, and model folders that are not loadable weights."""
    import zmq.auth

    folder = tmp_path_factory.mktemp("inputs")
    np.save(folder / "codes.npy", np.zeros((1, 4, 8), dtype=np.int64))
    np.save(folder / "latents.npy", np.zeros((1, 16, 8), dtype=np.float32))  # the tiny VoxCPM2 model: D = 16
    np.save(folder / "latents16.npy", np.zeros((1, 16, 8), dtype=np.float16))
    (folder / "garbage.npy").write_text("not numpy")
    (folder / "bad.yaml").write_text("graphs:\n  bucket: [1]\n")
    (folder / "keys").mkdir()
    zmq.auth.create_certificates(str(folder / "keys"), "server")
    weights = (TINY / "model.safetensors").read_bytes()
    for name, content in (("truncated", weights[: len(weights) // 2]),
                          ("lfs", b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64
                                  + b"\nsize 682293\n"),
                          ("wrongarch", _safetensors_bytes({"decoder.other.weight": torch.zeros(3, 3)}))):
        (folder / name).mkdir()
        shutil.copy(TINY / "config.json", folder / name / "config.json")
        (folder / name / "model.safetensors").write_bytes(content)
    (folder / "root" / "speech_tokenizer").mkdir(parents=True)
    (folder / "root" / "config.json").write_text(json.dumps({"architectures": ["Qwen3TTSForConditionalGeneration"]}))
    for item in TINY.iterdir():
        shutil.copy(item, folder / "root" / "speech_tokenizer" / item.name)
    (folder / "whisper").mkdir()
    (folder / "whisper" / "config.json").write_text(json.dumps({"architectures": ["WhisperModel"], "d_model": 8}))
    return folder


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One running sidecar for the cases that talk to one: the VoxCPM2 tiny model (latents, 4-frame patches)."""
    running = start_sidecar(tmp_path_factory.mktemp("live"), model=str(VOXCPM2_TINY))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        yield held.getsockname()[1]


def _run_case(request, tmp_path, data: Path, command: list[str], argv: list[str], words: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    fields = {"out": str(out), "data": str(data)}
    if any("{live}" in a for a in argv):
        fields["live"] = request.getfixturevalue("live").address
    if any("{busy_port}" in a for a in argv):
        fields["busy_port"] = str(request.getfixturevalue("busy_port"))
    args = [a.format(**fields) for a in argv]
    env = {**ENV, "TMPDIR": str(out)}  # a temp folder a command leaves behind would show in `out`
    proc = subprocess.run([*command, *args], capture_output=True, text=True, env=env, cwd=out,
                          timeout=CASE_TIMEOUT_S)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"exit code {proc.returncode}\n{proc.stderr}\n{proc.stdout}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{proc.stderr}"
    assert lines[0].startswith("error: ") and words.format(**fields) in lines[0], lines[0]
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    if "did not start" in words:  # the failed sidecar's log is kept, named in the line: nothing else
        assert all("sidecar.log" in p or "/sock" in p or p.startswith("code2wav-") for p in left), left
        assert "its log: " in lines[0]
    else:
        assert left == [], f"written: {left}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_and_exit_2(request, tmp_path, data, case):
    _, command, argv, words = case
    _run_case(request, tmp_path, data, command, argv, words)


@pytest.mark.skipif(not NO_CUDA, reason="these devices exist on a CUDA machine")
@pytest.mark.parametrize("case", CPU_ONLY_CASES, ids=[c[0] for c in CPU_ONLY_CASES])
def test_a_missing_device_is_one_line_and_exit_2(request, tmp_path, data, case):
    _, command, argv, words = case
    _run_case(request, tmp_path, data, command, argv, words)


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="vllm-omni is installed here")
@pytest.mark.parametrize("case", NO_VLLM_OMNI_CASES, ids=[c[0] for c in NO_VLLM_OMNI_CASES])
def test_a_missing_optional_package_is_one_line_naming_what_to_install(request, tmp_path, data, case):
    _, command, argv, words = case
    _run_case(request, tmp_path, data, command, argv, words)


def test_the_table_covers_every_command():
    commands = {argv[0] if command == CLI and argv else ("soak" if command == SOAK else "") for _, command, argv, _ in
                CASES}
    assert {"serve", "decode", "keygen", "demo", "bench", "profile", "fidelity", "soak"} <= commands
    assert len(CASES) >= 40


def test_an_internal_failure_is_one_line_naming_a_log_with_the_traceback(tmp_path):
    """A failure nobody planned for (here a command body that raises KeyError, run by the guard every command runs
    under) is one line that says so and names a log file holding the traceback; exit code 1."""
    script = ("import sys\nfrom code2wav.sidecar import cli_checks\n"
              "def body():\n    raise KeyError('boom')\n"
              "sys.exit(cli_checks.run_guarded('decode', body))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**ENV, "TMPDIR": str(tmp_path)}, timeout=60)
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: internal failure in decode: KeyError: 'boom' (traceback in ")
    log = Path(line.split("traceback in ", 1)[1].split(";", 1)[0])
    assert log.parent == tmp_path and "Traceback" in log.read_text() and "KeyError: 'boom'" in log.read_text()
