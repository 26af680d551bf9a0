"""What the sidecar's loop thread spends its time on: a ``cProfile`` of that thread between two requests to the metrics
endpoint (``profile_loop: true``), for ``code2wav-sidecar bench --stages --stages-loop-profile`` (loadgen/stages.py).

At one stream on a GPU every CPU step of a chunk runs on the loop thread (message in, plan, launch, reply out:
``step_placement.on_loop``), so this is where the microseconds of the hand-off that are not the device's go. Off by
default: then nothing here exists and both paths answer 404. On:

- ``GET /debug/loop-profile/start`` starts a fresh profile of the loop thread (the metrics endpoint is served on
  it, so the handler enables the profiler there); a profile already running is dropped;
- ``GET /debug/loop-profile`` stops it and answers JSON: ``seconds`` (the profiled window) and ``functions``, one row
  per function the thread ran (``function``: ``file:line(name)``, the file relative to its package; ``calls``;
  ``self_s``: time in the function itself; ``cumulative_s``: with what it called), the ``MAX_ROWS`` largest by
  self time. 409 without a profile started.

The engine's worker thread (a step that does not run on the loop: on the CPU, every forward) is not profiled.
Profiling slows the thread several-fold per Python call: a stage table measured under it is not a latency figure.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import time
from pathlib import PurePath

LOOP_PROFILE_START_PATH = "/debug/loop-profile/start"
LOOP_PROFILE_PATH = "/debug/loop-profile"
MAX_ROWS = 300
"""Rows answered: the functions with the most self time."""


def function_name(file: str, line: int, name: str) -> str:
    """``file:line(name)`` with ``file`` from its package folder on (``sidecar/stepper.py``, ``zmq/sugar/socket.py``);
    built-ins keep their ``~`` file."""
    parts = PurePath(file).parts
    for anchor in ("code2wav", "site-packages", "dist-packages"):
        if anchor in parts[:-1]:
            parts = parts[len(parts) - 1 - parts[::-1].index(anchor) + 1:]
            break
    else:
        parts = parts[-2:]
    return f"{'/'.join(parts)}:{line}({name})"


class LoopProfile:
    """The loop thread's profiler; both methods run on the loop thread (the metrics endpoint's handlers)."""

    def __init__(self) -> None:
        self._profile: cProfile.Profile | None = None
        self._started_s = 0.0

    def start(self) -> bytes:
        if self._profile is not None:
            self._profile.disable()
        self._profile = cProfile.Profile()
        self._started_s = time.monotonic()
        self._profile.enable()
        return json.dumps({"started": True}).encode()

    def stop(self) -> tuple[int, bytes]:
        """``(HTTP status, JSON body)``: the rows of the profile started last."""
        profile, self._profile = self._profile, None
        if profile is None:
            return 409, json.dumps({"error": f"no profile running: GET {LOOP_PROFILE_START_PATH} first"}).encode()
        profile.disable()
        seconds = time.monotonic() - self._started_s
        stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, calls, self s, cum s, callers)}
        rows = [{"function": function_name(*key), "calls": calls, "self_s": self_s, "cumulative_s": cumulative_s}
                for key, (_, calls, self_s, cumulative_s, _) in stats.items()]
        rows.sort(key=lambda row: row["self_s"], reverse=True)
        return 200, json.dumps({"seconds": seconds, "functions": rows[:MAX_ROWS]}).encode()
