"""The sidecar's loop thread per chunk, from its profile (``sidecar/loop_profile.py``): what ``bench --stages
--stages-loop-profile N`` prints under each stage table and keeps in its JSON (``loop_profile``).

The sidecar profiles its loop thread over exactly the timed chunks of one kind of inputs (started before the first,
stopped after the last), so a function's calls and seconds divided by the chunks are its share of one chunk. The
loop's own waiting (the poll, busy or asleep) shows as self time of the loop's rows: the table is of where the
thread was, not only of the work it did. The profiler slows every Python call: compare rows with each other, not
with the stage table's microseconds.
"""

from __future__ import annotations

import json
from typing import Any

from code2wav.sidecar.loop_profile import LOOP_PROFILE_PATH, LOOP_PROFILE_START_PATH

from .spawn import SpawnedSidecar


class LoopProfileWindow:
    """Starts and stops the spawned sidecar's loop profile around the timed chunks (``stages.run_stream``)."""

    def __init__(self, spawned: SpawnedSidecar) -> None:
        self.spawned = spawned
        self.document: dict[str, Any] | None = None

    def start(self) -> None:
        self.spawned.get(LOOP_PROFILE_START_PATH)

    def stop(self) -> None:
        self.document = json.loads(self.spawned.get(LOOP_PROFILE_PATH))


def per_chunk(document: dict[str, Any], num_chunks: int, top: int) -> dict[str, Any]:
    """The ``top`` functions by self time, per chunk: ``calls_per_chunk``, ``self_us``, ``cumulative_us``; and the
    profiled window's seconds and the self time of every function profiled, per chunk (``self_us_total``)."""
    rows = document["functions"]
    return {"seconds": document["seconds"], "chunks": num_chunks,
            "self_us_total": document["self_s_total"] * 1e6 / num_chunks,
            "functions": [{"function": row["function"], "calls_per_chunk": row["calls"] / num_chunks,
                           "self_us": row["self_s"] * 1e6 / num_chunks,
                           "cumulative_us": row["cumulative_s"] * 1e6 / num_chunks} for row in rows[:top]]}


def format_loop_profile(title: str, profile: dict[str, Any]) -> str:
    """The table as ``bench --stages`` prints it."""
    lines = [f"{title}: {profile['chunks']} chunks in {profile['seconds']:.2f} s under the profiler, "
             f"{profile['self_us_total']:.1f} us of loop-thread time per chunk",
             f"{'calls/chunk':>11} {'self_us':>9} {'cum_us':>9}  function"]
    for row in profile["functions"]:
        lines.append(f"{row['calls_per_chunk']:>11.2f} {row['self_us']:>9.1f} {row['cumulative_us']:>9.1f}  "
                     f"{row['function']}")
    return "\n".join(lines)
