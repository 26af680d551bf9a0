"""Operator-facing log lines about clients and the server's life: one info line per client connect and
disconnect, rate-limited so that a reconnect storm cannot flood the log, and the shutdown summary.

Rate limit: at most ``max_lines_per_window`` connect/disconnect lines per ``window_s``; the events past it in
that window are counted, and the first line of a later window (or ``flush()``, called at shutdown) says
``... and K more client connects/disconnects`` with the counts. The clock is injected (tests drive it).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

__all__ = ["ConnLog", "shutdown_summary"]

DEFAULT_MAX_LINES_PER_WINDOW = 10
DEFAULT_WINDOW_S = 1.0


class ConnLog:
    def __init__(self, logger: logging.Logger, max_lines_per_window: int = DEFAULT_MAX_LINES_PER_WINDOW,
                 window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        if max_lines_per_window < 1 or window_s <= 0:
            raise ValueError("max_lines_per_window must be >= 1 and window_s > 0")
        self.log = logger
        self.max_lines_per_window = max_lines_per_window
        self.window_s = window_s
        self.clock = clock
        self._window_start_s = float("-inf")
        self._lines_in_window = 0
        self._suppressed = {"connect": 0, "disconnect": 0}

    def connected(self, client_id: str, num_clients: int) -> None:
        self._emit("connect", "client %r connected (%d connected)", client_id, num_clients)

    def disconnected(self, client_id: str, reason: str, num_streams: int, num_clients: int) -> None:
        self._emit("disconnect", "client %r disconnected (%s; %d open streams aborted; %d connected)",
                   client_id, reason, num_streams, num_clients)

    def flush(self) -> None:
        """Log the count of suppressed lines, if any (at shutdown, or when a new window opens)."""
        if any(self._suppressed.values()):
            self.log.info("... and %d more client connects, %d more disconnects (log rate limit: %d lines per "
                          "%gs)", self._suppressed["connect"], self._suppressed["disconnect"],
                          self.max_lines_per_window, self.window_s)
            self._suppressed = {"connect": 0, "disconnect": 0}

    def _emit(self, kind: str, fmt: str, *args: object) -> None:
        now = self.clock()
        if now - self._window_start_s >= self.window_s:
            self.flush()
            self._window_start_s = now
            self._lines_in_window = 0
        if self._lines_in_window >= self.max_lines_per_window:
            self._suppressed[kind] += 1
            return
        self._lines_in_window += 1
        self.log.info(fmt, *args)


def _counter_total(counter) -> float:
    """The sum over all label sets of a prometheus_client Counter."""
    return sum(sample.value for metric in counter.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


def _errors_by_code(counter) -> str:
    """``N errors returned`` and, when N > 0, how many of each code: ``(5 unavailable, 3 not_found)``."""
    counts: dict[str, int] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                code = sample.labels.get("code", "?")
                counts[code] = counts.get(code, 0) + int(sample.value)
    total = sum(counts.values())
    if not total:
        return "0 errors returned"
    parts = ", ".join(f"{n} {code}" for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{total} errors returned ({parts})"


def shutdown_summary(logger: logging.Logger, metrics, queued_at_signal: int, open_streams_at_signal: int,
                     drain_s: float) -> None:
    """The last lines of a server's log: what was in flight at the signal and what it served in its life."""
    logger.info("shutdown: drained %d chunks (queued or in the engine at the signal) of %d open streams in %.2fs; "
                "served %d chunks (%.1f s of audio) since start, %s",
                queued_at_signal, open_streams_at_signal, drain_s, _counter_total(metrics.chunks),
                _counter_total(metrics.audio_seconds), _errors_by_code(metrics.errors))
