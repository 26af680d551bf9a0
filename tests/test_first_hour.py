"""A newcomer's first hour (issue 18): both sides default to one address, a second ``serve`` refuses instead of
stealing the socket, start-up mistakes end in one line and exit code 2, a client without a server gets a typed
error that says what to do, connect/disconnect lines are rate-limited, and an idle CPU server fits a laptop.
CLI behaviour is checked through ``subprocess`` against real servers (tiny golden model, CPU)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from code2wav.client.vllm_omni.settings import DelegateSettings
from code2wav.loadgen.spawn import spawn_sidecar
from code2wav.proto.address import default_address
from code2wav.sidecar.arena_sizing import plan_arena
from code2wav.sidecar.config import ServerConfig, load_config, state_memory_bytes
from code2wav.sidecar.connlog import ConnLog
from conftest import ROOT, TINY, start_sidecar

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
ENV.pop("CODE2WAV_SIDECAR_ADDRESS", None)

README_CLIENT_EXAMPLE = """\
import torch
from code2wav.client import SidecarClient

with SidecarClient(timeout_s=30) as c:             # no address: the one `code2wav-sidecar serve` binds by default
    m = c.models[0]                                 # what the server decodes: quantizers, codebook, sample rate
    codes = torch.randint(0, m.codebook_size, (m.num_quantizers, 30))   # [Q, frames], as a TTS model emits them
    s = c.open_stream("req-1")                      # mode="exact" (default) or "window"
    first = s.decode(codes[:, :5])                  # float32 [5 * samples_per_frame]
    rest = s.decode(codes[:, 5:], final=True)       # final=True frees the stream after replying
    print(torch.cat([first, rest]).shape, m.sample_rate)
"""


def _serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "code2wav.sidecar", "serve", *args]


def _run(cmd: list[str], env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, cwd=ROOT, timeout=timeout_s)


def _one_error_line(stderr: str) -> str:
    """The single ``error:`` line of a failed command (log lines may precede it); no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def _listening_tcp_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


# ------------------------------------------------------------------ 3. defaults that agree

def test_default_address_rule_is_shared_by_server_client_and_delegate(monkeypatch, tmp_path):
    uid = 1234
    assert default_address({}, uid) == "ipc:///tmp/code2wav-sidecar-1234/code2wav/sidecar.sock"
    assert default_address({"XDG_RUNTIME_DIR": "/run/user/1234/"}, uid) == \
        "ipc:///run/user/1234/code2wav/sidecar.sock"
    explicit = {"XDG_RUNTIME_DIR": "/run/user/1234", "CODE2WAV_SIDECAR_ADDRESS": "tcp://127.0.0.1:5555"}
    assert default_address(explicit, uid) == "tcp://127.0.0.1:5555"
    assert default_address({"CODE2WAV_SIDECAR_ADDRESS": ""}, uid) == default_address({}, uid)

    monkeypatch.delenv("CODE2WAV_SIDECAR_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    expected = f"ipc://{tmp_path}/code2wav/sidecar.sock"
    assert ServerConfig().address == expected  # serve's default
    assert DelegateSettings().address == expected  # the vLLM-Omni delegate's default
    assert DelegateSettings.from_sources({}, {"XDG_RUNTIME_DIR": str(tmp_path)}).address == expected
    with pytest.raises(cerr.SidecarNotRunning) as info:  # the client's default: it names the address it tried
        SidecarClient(connect_timeout_s=0.2)
    assert expected in str(info.value)


def test_readme_client_example_runs_against_serve_defaults(tmp_path):
    """``serve`` with no --address and the README's client example with no address meet (same environment)."""
    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    (tmp_path / "xdg").mkdir(mode=0o700)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(_serve_cmd("--model", str(TINY), "--device", "cpu", "--metrics-port", "0"),
                                stdout=subprocess.PIPE, stderr=log_file, text=True, env=env, cwd=ROOT)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("code2wav-sidecar ready:"), log_path.read_text()
        assert f"address=ipc://{tmp_path}/xdg/code2wav/sidecar.sock " in ready
        example = _run([sys.executable, "-c", README_CLIENT_EXAMPLE], env=env)
        assert example.returncode == 0, example.stderr
        assert example.stdout.split() == ["torch.Size([1440])", "24000"]  # 30 frames x 48 samples (tiny model)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    log_text = log_path.read_text()
    assert "connected (1 connected)" in log_text and "disconnected (bye; 0 open streams aborted" in log_text
    assert "shutdown: drained 0 chunks" in log_text and "served 2 chunks" in log_text
    assert not (tmp_path / "xdg" / "code2wav" / "sidecar.sock").exists()  # the server removes its own socket


# ------------------------------------------------------------------ 4. refuse, don't steal

def test_second_serve_on_a_live_ipc_address_refuses_and_the_first_keeps_serving(tmp_path, golden_cases):
    first = start_sidecar(tmp_path)
    try:
        second = _run(_serve_cmd("--address", first.address, "--model", str(TINY), "--device", "cpu",
                                 "--metrics-port", "0"))
        assert second.returncode == 2
        line = _one_error_line(second.stderr)
        assert "address in use by a running sidecar" in line and first.address in line
        assert os.path.exists(first.address[len("ipc://"):])  # not deleted by the second one
        with SidecarClient(first.address) as client:  # the first still serves, bit-exact
            wav = client.open_stream("after").decode(golden_cases["codes"][0][:, :5])
        assert (wav - golden_cases["full"][0, 0, :wav.numel()]).abs().max().item() <= 1e-5
        assert "code2wav-sidecar-probe" in first.log()  # the probe said hello (and bye) like a client
    finally:
        assert first.stop() == 0


def test_stale_ipc_socket_is_removed_and_serve_starts(tmp_path):
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_dir / "sidecar.sock"))  # bound, never listening, closed: what a crashed server leaves
    stale.close()
    assert (sock_dir / "sidecar.sock").exists()
    running = spawn_sidecar("--model", str(TINY), "--device", "cpu", workdir=tmp_path)
    try:
        assert "removing the stale socket" in running.log()
        with SidecarClient(running.address) as client:
            assert client.ping() > 0
    finally:
        running.stop()


def test_ipc_path_held_by_a_regular_file_is_refused(tmp_path):
    (tmp_path / "sock").mkdir(mode=0o700)
    (tmp_path / "sock" / "sidecar.sock").write_text("not a socket")
    proc = _run(_serve_cmd("--address", f"ipc://{tmp_path}/sock/sidecar.sock", "--model", str(TINY),
                           "--device", "cpu", "--metrics-port", "0"))
    assert proc.returncode == 2 and "is not a socket" in _one_error_line(proc.stderr)
    assert (tmp_path / "sock" / "sidecar.sock").read_text() == "not a socket"


@pytest.mark.parametrize("case", ["tcp_port", "metrics_port", "log_level", "model_folder"])
def test_serve_startup_mistakes_end_in_one_line_and_exit_2(tmp_path, case):
    held = _listening_tcp_socket()
    port = held.getsockname()[1]
    args = ["--model", str(TINY), "--device", "cpu", "--metrics-port", "0",
            "--address", f"ipc://{tmp_path}/sock/sidecar.sock"]
    expected = {
        "tcp_port": (["--address", f"tcp://127.0.0.1:{port}"], f"address in use: tcp://127.0.0.1:{port}"),
        "metrics_port": (["--metrics-port", str(port)], f"metrics port {port} on 127.0.0.1 is not available"),
        "log_level": (["--log-level", "loud"], "--log-level loud: choose one of debug, info, warning"),
        "model_folder": (["--model", str(tmp_path / "missing")], "no such folder"),
    }[case]
    try:
        proc = _run(_serve_cmd(*args, *expected[0]))
    finally:
        held.close()
    assert proc.returncode == 2
    assert expected[1] in _one_error_line(proc.stderr)


# ------------------------------------------------------------------ 5. a client without a server

def test_client_without_server_gets_typed_error_within_connect_timeout(tmp_path):
    address = f"ipc://{tmp_path}/nobody/sidecar.sock"
    t0 = time.monotonic()
    with pytest.raises(cerr.SidecarNotRunning) as info:
        SidecarClient(address, connect_timeout_s=0.5)
    elapsed_s = time.monotonic() - t0
    assert elapsed_s < 3.0  # the 0.5 s handshake deadline plus the wait's 1 s grace and slack, not the 5 s default
    assert isinstance(info.value, cerr.Unavailable)  # existing handlers of Unavailable still catch it
    message = str(info.value)
    assert address in message and f"code2wav-sidecar serve --address {address}" in message
    assert "does not exist" in message


def test_demo_without_server_prints_one_line(tmp_path):
    address = f"ipc://{tmp_path}/nobody/sidecar.sock"
    proc = _run([sys.executable, "-m", "code2wav.sidecar", "demo", "--address", address])
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert address in line and "code2wav-sidecar serve" in line


# ------------------------------------------------------------------ 9. connect/disconnect lines, rate-limited

class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_connlog_rate_limits_and_reports_what_it_held_back():
    now = [100.0]
    logger = logging.getLogger("test.connlog")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    sink = _Lines()
    logger.addHandler(sink)
    connlog = ConnLog(logger, max_lines_per_window=3, window_s=1.0, clock=lambda: now[0])
    for i in range(5):
        connlog.connected(f"c{i}", i + 1)
    connlog.disconnected("c0", "bye", 2, 4)
    assert sink.lines == ["client 'c0' connected (1 connected)", "client 'c1' connected (2 connected)",
                          "client 'c2' connected (3 connected)"]
    now[0] += 1.0  # a new window: the held-back count comes first, then the line
    connlog.disconnected("c1", "ttl", 0, 3)
    assert sink.lines[3].startswith("... and 2 more client connects, 1 more disconnects")
    assert sink.lines[4] == "client 'c1' disconnected (ttl; 0 open streams aborted; 3 connected)"
    connlog.flush()  # nothing held back: nothing to say
    assert len(sink.lines) == 5
    logger.removeHandler(sink)


def test_the_shutdown_line_says_which_errors_were_returned():
    """An operator reading a restarted sidecar's last line sees what its errors were (in a pool soak: one
    ``invalid_argument`` per client, its first ping after the restart refused before a handshake)."""
    from prometheus_client import CollectorRegistry

    from code2wav.proto import ErrorCode
    from code2wav.sidecar.connlog import shutdown_summary
    from code2wav.sidecar.metrics import Metrics

    logger = logging.getLogger("test.shutdown")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    sink = _Lines()
    logger.addHandler(sink)
    metrics = Metrics(CollectorRegistry())
    shutdown_summary(logger, metrics, 0, 0, 0.0)
    assert sink.lines[-1].endswith("since start, 0 errors returned")
    for code, times in ((ErrorCode.INVALID_ARGUMENT, 8), (ErrorCode.NOT_FOUND, 1), (ErrorCode.UNAVAILABLE, 3)):
        metrics.errors.labels(code=code.value).inc(times)
    shutdown_summary(logger, metrics, 2, 1, 0.5)
    assert sink.lines[-1].endswith("since start, 12 errors returned (8 invalid_argument, 3 unavailable, 1 not_found)")
    logger.removeHandler(sink)


# ------------------------------------------------------------------ 10. a CPU server that fits a laptop

def test_state_memory_default_depends_on_the_device():
    cfg = ServerConfig()
    assert cfg.streams.state_memory_bytes == "auto"
    assert state_memory_bytes(cfg) is None  # auto: arena_sizing.plan_arena decides for the device
    cpu = plan_arena(1 << 20, max_streams=None, state_memory_bytes=state_memory_bytes(cfg), free_device_bytes=None,
                     graph_reserve_bytes=0, margin_bytes=0, auto_max_streams=4096)
    assert (cpu.budget_bytes, cpu.source) == (256 << 20, "cpu_default")
    pinned = load_config(None, {"streams": {"state_memory_bytes": 64 << 20}})
    assert state_memory_bytes(pinned) == 64 << 20


def _no_nulls(value, where: str = "") -> list[str]:
    if value is None:
        return [where or "<root>"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _no_nulls(v, f"{where}.{k}".lstrip("."))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _no_nulls(v, f"{where}[{i}]")]
    return []


def test_shipped_config_example_has_numbers_not_nulls():
    import yaml

    path = ROOT / "deploy" / "sidecar.yaml"
    data = yaml.safe_load(path.read_text())
    assert _no_nulls(data) == []
    cfg = load_config(path)
    assert isinstance(cfg.streams.state_memory_bytes, int)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_idle_cpu_server_with_the_shipped_model_fits_a_laptop(tmp_path):
    """The shipped architecture (random weights) on CPU with every default: before, the 2 GiB arena alone put an
    idle server at 2.8 GB RSS; with the CPU default of 256 MiB it stays under 1.5 GiB."""
    running = spawn_sidecar("--model", "default", "--device", "cpu", workdir=tmp_path, timeout_s=300)
    try:
        rss = _rss_bytes(running.proc.pid)
        assert "budget 0.25 GiB" in running.log()  # the arena line: 256 MiB
        assert rss < 1.5 * 2**30, f"idle CPU server RSS {rss / 2**30:.2f} GiB"
        with SidecarClient(running.address) as client:  # and it serves
            info = client.models[0]
            wav = client.open_stream("x").decode(torch.zeros(info.num_quantizers, 2, dtype=torch.long))
            assert wav.numel() == 2 * info.samples_per_frame
    finally:
        running.stop()
