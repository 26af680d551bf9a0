"""Start a real ``code2wav-sidecar serve`` process and wait for its ready line (used by demo, bench, tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class SpawnFailed(RuntimeError):
    """The spawned sidecar exited or never became ready. ``str()`` is one line: the sidecar's own ``error:`` line
    (or its last log line) and where its log is; ``log_text`` is the whole log."""

    def __init__(self, line: str, log_text: str, returncode: int | None) -> None:
        super().__init__(line)
        self.log_text = log_text
        self.returncode = returncode


@dataclass
class SpawnedSidecar:
    proc: subprocess.Popen
    address: str
    metrics_url: str
    log_path: Path
    ready_line: str
    owned_workdir: Path | None = None  # a temp folder this spawn made: removed by ``stop`` (its log with it)

    def scrape(self, timeout_s: float = 5.0) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=timeout_s) as resp:
            return resp.read().decode()

    def url(self, path: str) -> str:
        """``path`` (e.g. ``/healthz``) on its metrics endpoint."""
        return self.metrics_url.rsplit("/", 1)[0] + path

    def get(self, path: str, timeout_s: float = 10.0) -> bytes:
        """The body of ``path`` on its metrics endpoint (e.g. ``/debug/chunk-stages``)."""
        with urllib.request.urlopen(self.url(path), timeout=timeout_s) as resp:
            return resp.read()

    def http_status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url(path), timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def banner(self) -> str:
        """The ready line and where the sidecar's log goes (what ``demo`` and ``bench`` print)."""
        kept = " (a temp folder: removed at exit unless the sidecar fails)" if self.owned_workdir else ""
        return f"{self.ready_line}\nsidecar log: {self.log_path}{kept}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 15.0, log_copy: str | Path | None = None) -> int:
        """Stop the sidecar, copy its log to ``log_copy`` (if given), and remove the temp folder the spawn made
        (socket, log) unless it failed (exit code not 0 or a signal's), so its log stays to read."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if log_copy is not None:
            shutil.copyfile(self.log_path, log_copy)
        if self.owned_workdir is not None and self.proc.returncode in (0, -15, -9):
            shutil.rmtree(self.owned_workdir, ignore_errors=True)
        return self.proc.returncode


def _failure_line(log_text: str, returncode: int | None, log_path: Path) -> str:
    """The sidecar's own ``error:`` line (without the prefix), else its last log line, and where the log is."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln[len("error: "):] for ln in lines if ln.startswith("error: ")]
    said = errors[-1] if errors else (lines[-1] if lines else "no output")
    return f"the sidecar did not start (exit code {returncode}): {said} (its log: {log_path})"


def spawn_sidecar(*args: str, workdir: Path | None = None, timeout_s: float = 120.0) -> SpawnedSidecar:
    """``python -m code2wav.sidecar serve --address ipc://<workdir>/sock/sidecar.sock --metrics-port 0 *args``;
    without ``workdir`` a temp folder, removed by ``stop``. ``SpawnFailed`` when it does not become ready."""
    owned = None if workdir else Path(tempfile.mkdtemp(prefix="code2wav-"))
    workdir = Path(workdir or owned)
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
            return SpawnedSidecar(proc, fields["address"], fields["metrics"], log_path, line.strip(), owned)
        if not line and proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log_text = log_path.read_text(errors="replace")
    raise SpawnFailed(_failure_line(log_text, proc.returncode, log_path), log_text, proc.returncode)
