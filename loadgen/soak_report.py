"""The soak's report from what it collected (``loadgen/soak.py``): client outcome lines read back, p99 per window,
the sidecar's own means per window from ``/metrics`` samples. Pure functions of their inputs."""

from __future__ import annotations

import json
from pathlib import Path

WINDOW_S = 10.0


def read_client(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    last = lines[-1] if lines else {"sent": 0, "decoded": 0, "bad_audio": 0, "failed": {}, "failed_unsent": {}}
    latencies = [entry for line in lines for entry in line["latencies"]]  # (wall time sent, seconds, sidecar)
    return {"exited": bool(lines) and last.get("kind") == "exit", "sent": last["sent"], "decoded": last["decoded"],
            "bad_audio": last["bad_audio"], "failed": last["failed"], "failed_unsent": last["failed_unsent"],
            "by_sidecar": last.get("by_sidecar", {}), "latencies": latencies,
            "placements": [entry for line in lines for entry in line.get("placements", [])],
            "slips": [t_wall for line in lines for t_wall in line.get("slips", [])],
            "failover": last.get("failover")}  # the pool's failover_stats at its last flush (moves: at exit)


def server_windows(samples: list[dict]) -> list[dict]:
    """Server-side means per WINDOW_S: the differences of consecutive ``server`` samples, each counted in the
    window where the interval ends; an interval over which a count went down (the sidecar restarted) is
    skipped."""
    names = ("chunk_latency_seconds", "engine_step_seconds", "batch_wait_seconds")
    totals: dict[int, dict[str, list[float]]] = {}
    scraped = [s for s in samples if s.get("server")]
    for before, after in zip(scraped, scraped[1:]):
        window = totals.setdefault(int(after["t_s"] // WINDOW_S), {n: [0.0, 0.0] for n in names})
        for name in names:
            n = after["server"].get(f"code2wav_sidecar_{name}_count", 0) - \
                before["server"].get(f"code2wav_sidecar_{name}_count", 0)
            total = after["server"].get(f"code2wav_sidecar_{name}_sum", 0) - \
                before["server"].get(f"code2wav_sidecar_{name}_sum", 0)
            if n >= 0 and total >= 0:
                window[name][0] += n
                window[name][1] += total
    return [{"window_start_s": index * WINDOW_S,
             **{name.replace("_seconds", "_ms_mean"): round(1e3 * total / n, 2) if n > 0 else None
                for name, (n, total) in totals[index].items()}} for index in sorted(totals)]


def p99_windows(latencies: list[list[float]], t0: float) -> list[dict]:
    """``latencies``: (wall time sent, seconds, ...) per decoded chunk; p99 per WINDOW_S from ``t0``."""
    windows: dict[int, list[float]] = {}
    for t_sent, seconds, *_ in latencies:
        windows.setdefault(int((t_sent - t0) // WINDOW_S), []).append(seconds)
    report = []
    for index in sorted(windows):
        values = sorted(windows[index])
        report.append({"window_start_s": index * WINDOW_S, "chunks": len(values),
                       "p99_ms": 1e3 * values[min(len(values) - 1, int(0.99 * len(values)))]})
    return report


def sent_failures(stats: dict) -> int:
    return sum(stats["failed"].values())
