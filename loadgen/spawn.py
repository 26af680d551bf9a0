"""Start a real ``code2wav-sidecar serve`` process and wait for its ready line (used by demo, bench, tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class SpawnedSidecar:
    proc: subprocess.Popen
    address: str
    metrics_url: str
    log_path: Path
    ready_line: str

    def scrape(self, timeout_s: float = 5.0) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=timeout_s) as resp:
            return resp.read().decode()

    def http_status(self, path: str) -> int:
        url = self.metrics_url.rsplit("/", 1)[0] + path
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def banner(self) -> str:
        """The ready line and where the sidecar's log goes (what ``demo`` and ``bench`` print)."""
        return f"{self.ready_line}\nsidecar log: {self.log_path}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn_sidecar(*args: str, workdir: Path | None = None, timeout_s: float = 120.0) -> SpawnedSidecar:
    """``python -m code2wav.sidecar serve --address ipc://<workdir>/sock/sidecar.sock --metrics-port 0 *args``."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="code2wav-"))
    address = f"ipc://{workdir}/sock/sidecar.sock"
    log_path = workdir / "sidecar.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "code2wav.sidecar", "serve", "--address", address, "--metrics-port", "0", *args]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("code2wav-sidecar ready:"):
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            return SpawnedSidecar(proc, fields["address"], fields["metrics"], log_path, line.strip())
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the sidecar did not become ready (exit code {proc.returncode}); its log ({log_path}):\n"
                       f"{log_path.read_text()}")
