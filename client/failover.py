"""What a pool's failovers and drains cost, counted (``SidecarPool.failover_stats()``), and how a move is classified.

A *move* re-opens a pooled stream on another sidecar and replays its history there (``pool_stream.py``):
``failover`` when its sidecar died, restarted or refused its chunk as unavailable; ``drain`` when its sidecar
announced a drain and the stream moved at a chunk boundary. Each move records the frames replayed and the time from
the move's start to the replay's last reply (``recovery_s``: what the chunk in flight waited for, on top of its own
decode). A stream that found no sidecar to move to is counted as lost (the caller saw ``StreamLost``).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from .errors import DeadlineExceeded, SidecarError, StreamLost, Unavailable

__all__ = ["FailoverStats", "MoveRecord", "sidecar_gone", "MOVE_REASONS"]

MOVE_REASONS = ("failover", "drain")
RECENT_MOVES = 4096
"""Moves kept for ``failover_stats()['recent']`` (the oldest are dropped; the totals keep counting)."""


def sidecar_gone(error: BaseException) -> bool:
    """Whether a chunk's error means its sidecar cannot go on with the stream (dead, restarted, forgot this client,
    shutting down): then the pool moves the stream. Not a deadline (the outcome is unknown: the caller resends)."""
    return isinstance(error, StreamLost) or (isinstance(error, Unavailable) and not isinstance(error, DeadlineExceeded))


@dataclass(frozen=True)
class MoveRecord:
    reason: str  # "failover" | "drain"
    stream_id: str
    from_address: str
    to_address: str
    replay_frames: int
    replay_audio_s: float  # the replayed frames' audio duration
    recovery_s: float  # move started -> the replay's last reply (the chunk in flight was resent right after it)
    at_s: float  # time.time() when it finished


class FailoverStats:
    """Thread-safe counters of a pool's moves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._moves = {reason: 0 for reason in MOVE_REASONS}
        self._replay_frames = 0
        self._replay_audio_s = 0.0
        self._recovery_s_total = 0.0
        self._recovery_s_max = 0.0
        self._streams_lost = 0
        self._recent: deque[MoveRecord] = deque(maxlen=RECENT_MOVES)

    def moved(self, record: MoveRecord) -> None:
        with self._lock:
            self._moves[record.reason] += 1
            self._replay_frames += record.replay_frames
            self._replay_audio_s += record.replay_audio_s
            self._recovery_s_total += record.recovery_s
            self._recovery_s_max = max(self._recovery_s_max, record.recovery_s)
            self._recent.append(record)

    def lost(self) -> None:
        with self._lock:
            self._streams_lost += 1

    def snapshot(self) -> dict:
        """``failovers``, ``drain_moves``, ``replay_frames``, ``replay_audio_s``, ``recovery_s_total``,
        ``recovery_s_max``, ``streams_lost`` and ``recent`` (the latest moves, oldest first, as dicts)."""
        with self._lock:
            return {"failovers": self._moves["failover"], "drain_moves": self._moves["drain"],
                    "replay_frames": self._replay_frames, "replay_audio_s": self._replay_audio_s,
                    "recovery_s_total": self._recovery_s_total, "recovery_s_max": self._recovery_s_max,
                    "streams_lost": self._streams_lost, "recent": [vars(r).copy() for r in self._recent]}


def now_s() -> float:
    return time.monotonic()


def give_up_error(stream_id: str, cause: SidecarError | BaseException) -> StreamLost:
    return StreamLost(f"stream {stream_id!r} lost its sidecar and no other sidecar of the pool could take it over "
                      f"({cause})")
