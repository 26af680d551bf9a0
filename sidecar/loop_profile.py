"""What the sidecar's loop thread spends its time on: a ``cProfile`` of that thread between two requests to the metrics
endpoint (``profile_loop: true``), for ``code2wav-sidecar bench --stages --stages-loop-profile`` (loadgen/stages.py).

At one stream on a GPU every CPU step of a chunk runs on the loop thread (message in, plan, launch, reply out:
``step_placement.on_loop``), so this is where the microseconds of the hand-off that are not the device's go. Off by
default: then nothing here exists and both paths answer 404. On:

- ``GET /debug/loop-profile/start`` starts a fresh profile (the metrics endpoint is served on the loop thread, so
  the handler enables the profiler there); a profile already running is dropped; one left running ends by itself
  after ``MAX_PROFILE_S``. 409 if another profiler is active in the process (Python 3.12+ allows only one);
- ``GET /debug/loop-profile`` stops it and answers JSON: ``seconds`` (the profiled window), ``self_s_total`` (the
  self time of every function profiled) and ``functions``, one row per function (``function``: ``file:line(name)``,
  the file from its package folder on; ``calls``; ``self_s``: time in the function itself; ``cumulative_s``: with
  what it called), the ``MAX_ROWS`` largest by self time. 409 without a profile running.

Up to Python 3.11 cProfile sees only the thread that enabled it; from 3.12 on it runs on ``sys.monitoring`` and sees
every thread of the process, so the rows then include the engine's worker thread (on the CPU, every forward) and the
doorbell watchdog. Profiling slows each Python call several-fold: a stage table measured under it is not a latency
figure. A debugging tool: a client that can reach the metrics endpoint can slow the loop for ``MAX_PROFILE_S``.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import pstats
import time
from pathlib import PurePath

LOOP_PROFILE_START_PATH = "/debug/loop-profile/start"
LOOP_PROFILE_PATH = "/debug/loop-profile"
MAX_ROWS = 300
"""Rows answered: the functions with the most self time."""
MAX_PROFILE_S = 600.0
"""A profile nobody stops ends by itself after this long."""


def function_name(file: str, line: int, name: str) -> str:
    """``file:line(name)`` with ``file`` from its package folder on (``sidecar/stepper.py``, ``zmq/sugar/socket.py``):
    after the last ``code2wav``, ``site-packages`` or ``dist-packages`` folder of its path, else its last two parts;
    built-ins keep their ``~`` file."""
    parts = PurePath(file).parts
    anchors = [i for i, part in enumerate(parts[:-1]) if part in ("code2wav", "site-packages", "dist-packages")]
    parts = parts[anchors[-1] + 1:] if anchors else parts[-2:]
    return f"{'/'.join(parts)}:{line}({name})"


class LoopProfile:
    """The loop thread's profiler; both methods run on the loop thread (the metrics endpoint's handlers)."""

    def __init__(self) -> None:
        self._profile: cProfile.Profile | None = None
        self._started_s = 0.0
        self._expiry: asyncio.TimerHandle | None = None

    def start(self) -> tuple[int, bytes]:
        self._drop()
        profile = cProfile.Profile()
        try:
            profile.enable()
        except ValueError as exc:  # Python 3.12+: another profiler is active in this process
            return 409, json.dumps({"error": f"cannot profile: {exc}"}).encode()
        self._profile, self._started_s = profile, time.monotonic()
        self._expiry = asyncio.get_running_loop().call_later(MAX_PROFILE_S, self._drop)
        return 200, json.dumps({"started": True}).encode()

    def stop(self) -> tuple[int, bytes]:
        """``(HTTP status, JSON body)``: the rows of the profile running."""
        profile = self._profile
        if profile is None:
            return 409, json.dumps({"error": f"no profile running: GET {LOOP_PROFILE_START_PATH} first"}).encode()
        seconds = time.monotonic() - self._started_s
        self._drop()
        stats = pstats.Stats(profile).stats if profile.getstats() else {}
        # {(file, line, name): (primitive calls, calls, self s, cumulative s, callers)}
        rows = [{"function": function_name(*key), "calls": calls, "self_s": self_s, "cumulative_s": cumulative_s}
                for key, (_, calls, self_s, cumulative_s, _) in stats.items()]
        rows.sort(key=lambda row: row["self_s"], reverse=True)
        return 200, json.dumps({"seconds": seconds, "self_s_total": sum(row["self_s"] for row in rows),
                                "functions": rows[:MAX_ROWS]}).encode()

    def _drop(self) -> None:
        """End the profile running, if any (its rows are gone)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._profile is not None:
            self._profile.disable()
            self._profile = None
