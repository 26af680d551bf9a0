"""The soak's sidecars (``loadgen/soak.py``): N ``serve`` processes started together, each in a folder of its own
(``s0/``, ``s1/``, ...; the folder itself for one), so each keeps its ipc:// address across a restart; the faults
done to them (SIGKILL, SIGTERM and restart) and what is sampled of them (RSS, ``/metrics``, GPU memory)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

from .spawn import SpawnedSidecar, spawn_sidecar

START_TIMEOUT_S = 300.0  # a sidecar's start, CUDA graph captures included (several share the GPU while capturing)


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_used_bytes() -> int | None:
    """GPU memory in use on GPU 0 (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
        return int(float(out.split()[0])) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def server_means(sidecar: SpawnedSidecar) -> dict[str, float] | None:
    """Cumulative sums and counts of the sidecar's chunk latency (arrival -> reply), engine step and batch wait
    (``/metrics``); means over an interval are differences of two samples. None if the sidecar does not answer
    (down, draining, a cut-off reply): the soak goes on."""
    from .server_metrics import scrape_counters  # noqa: PLC0415

    try:
        return scrape_counters(sidecar.scrape(timeout_s=1.0))
    except Exception:  # noqa: BLE001 - any failed scrape is a missing sample, never the end of the soak
        return None


class SoakSidecars:
    """``count`` sidecars of ``serve_args``, started in parallel; ``running[i]`` is sidecar i's current process."""

    def __init__(self, serve_args: list[str], workdir: Path, count: int,
                 extra_args: dict[int, list[str]] | None = None) -> None:
        self.serve_args = serve_args
        self.extra_args = extra_args or {}  # sidecar index -> its own extra serve arguments (after the common ones)
        self.folders = [workdir] if count == 1 else [workdir / f"s{index}" for index in range(count)]
        started: list[SpawnedSidecar | BaseException | None] = [None] * count

        def start(index: int) -> None:
            try:
                started[index] = self._spawn(index)
            except BaseException as exc:  # noqa: BLE001 - raised below, once every start has ended
                started[index] = exc

        threads = [threading.Thread(target=start, args=(index,)) for index in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failed = [s for s in started if not isinstance(s, SpawnedSidecar)]
        if failed:
            for sidecar in started:
                if isinstance(sidecar, SpawnedSidecar):
                    sidecar.stop()
            raise failed[0] if isinstance(failed[0], BaseException) else RuntimeError("a sidecar did not start")
        self.running: list[SpawnedSidecar] = started  # type: ignore[assignment]
        self.addresses = [sidecar.address for sidecar in self.running]
        self.down: set[int] = set()  # killed and not (yet) back

    def _spawn(self, index: int) -> SpawnedSidecar:
        folder = self.folders[index]
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "sidecar.log"
        if log.exists():  # a restart: keep the log of the process before (its kill or drain) as sidecar-N.log
            log.rename(folder / f"sidecar-{sum(1 for _ in folder.glob('sidecar-*.log'))}.log")
        return spawn_sidecar(*self.serve_args, *self.extra_args.get(index, []), workdir=folder,
                             timeout_s=START_TIMEOUT_S)

    def alive(self) -> list[int]:
        return [index for index, sidecar in enumerate(self.running)
                if index not in self.down and sidecar.proc.poll() is None]

    def kill(self, index: int) -> None:
        """SIGKILL sidecar ``index``: no drain, no reply; its clients learn it from the missing heartbeats."""
        self.down.add(index)
        self.running[index].proc.send_signal(signal.SIGKILL)
        self.running[index].proc.wait()

    def restart(self, index: int, t0: float, report: dict) -> None:
        """Start sidecar ``index`` again (same address, a new boot epoch); fills ``report`` (times from ``t0``)."""
        t_start = time.monotonic()
        self.running[index] = self._spawn(index)
        self.down.discard(index)
        report.update({"t_s": round(t_start - t0, 2), "ready_t_s": round(time.monotonic() - t0, 2),
                       "time_to_ready_s": round(time.monotonic() - t_start, 3)})

    def drain_and_restart(self, index: int, t0: float, report: dict) -> None:
        """SIGTERM sidecar ``index`` (it drains), start it again on the same address; fills ``report``."""
        t_term = time.monotonic()
        old = self.running[index]
        old.proc.send_signal(signal.SIGTERM)
        exit_code = old.proc.wait(timeout=120)
        t_down = time.monotonic()
        self.running[index] = self._spawn(index)
        report.update({"t_s": round(t_term - t0, 2), "drain_s": round(t_down - t_term, 3), "exit_code": exit_code,
                       "time_to_ready_s": round(time.monotonic() - t_down, 3),
                       "down_s": round(time.monotonic() - t_term, 3)})

    def sample(self, t_s: float, gpu: bool, scrape: bool) -> dict:
        """One sample: RSS (sidecar 0's, and every sidecar's when several), GPU memory, ``/metrics`` sums."""
        rss = [rss_bytes(s.proc.pid) if s.proc.poll() is None else None for s in self.running]
        servers = [server_means(s) if scrape and s.proc.poll() is None else None for s in self.running]
        sample = {"t_s": t_s, "sidecar_rss_bytes": rss[0], "gpu_used_bytes": gpu_used_bytes() if gpu else None,
                  "server": servers[0]}
        if len(self.running) > 1:
            sample.update({"rss_bytes_by_sidecar": rss, "servers": servers})
        return sample

    def stop(self) -> None:
        for sidecar in self.running:
            sidecar.stop()
