"""Where a pool opens its next stream (policy only: no sockets, no clocks; ``pool.py`` is the mechanism).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

The rules, in order:

1. Only sidecars that take streams are candidates: connected, answering heartbeats, not draining, still named
   by the pool's addresses (DNS), and not refused by a ``busy`` since their last load report.
2. A sidecar on the caller's own GPU (same host and GPU, CUDA IPC offered) comes first, so codes and audio
   travel by CUDA IPC; when it is full (no free slot left by its report and the streams placed since), the
   others take the stream and the bytes travel inline (spill-over).
3. Among equals, the least utilised: ``(open streams + streams placed here since its report) / capacity``,
   capacity being open streams + free slots by its load report (``proto.Load``); so a sidecar with half the
   slots gets half the streams. A sidecar that reports no load (an older server) counts the streams this pool
   placed there, against the mean capacity of the others (``NOMINAL_CAPACITY`` when none reports).
4. Ties: more free slots first, then the one chosen least recently (round robin among equal sidecars), then a
   per-pool random order (``salt``): many runners' pools that see the same reports (all sidecars idle, at start
   or after a restart) do not all pick the same sidecar for their first streams.

A full sidecar stays a candidate, last: its report may be stale, and its ``busy`` answer (the pool then tries
the next) is the truth.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from code2wav.proto import Load

__all__ = ["Candidate", "NOMINAL_CAPACITY", "rank", "utilisation"]

NOMINAL_CAPACITY = 64
"""The capacity assumed for a sidecar that reports no load, when no other sidecar of the pool reports one."""


@dataclass(frozen=True)
class Candidate:
    """What the policy knows of one sidecar when a stream is to be placed."""

    key: str  # its address
    takes_streams: bool  # rule 1
    load: Load | None  # its latest report (None: it does not report one)
    placed_since_report: int  # streams this pool opened there after that report was sent
    local_gpu: bool  # same host and GPU as the caller, CUDA IPC offered
    last_chosen: int = 0  # a counter value: when this pool last placed a stream there (0: never)
    open_here: int = 0  # streams of this pool open there now (used when it reports no load)


def _capacity(candidate: Candidate, default_capacity: float) -> float:
    if candidate.load is None:
        return default_capacity
    return float(max(1, candidate.load.capacity_slots))


def utilisation(candidate: Candidate, default_capacity: float) -> float:
    """Its share of slots in use, counting the streams placed since its report."""
    if candidate.load is None:
        return candidate.open_here / default_capacity
    return (candidate.load.open_streams + candidate.placed_since_report) / _capacity(candidate, default_capacity)


def _free(candidate: Candidate, default_capacity: float) -> float:
    if candidate.load is None:
        return default_capacity - candidate.open_here
    return candidate.load.free_slots - candidate.placed_since_report


def _tie_order(key: str, salt: int) -> bytes:
    """The last tie-break: a pool's own order of the sidecars (the key itself when ``salt`` is 0)."""
    if not salt:
        return key.encode()
    return hashlib.blake2b(key.encode(), digest_size=8, salt=salt.to_bytes(8, "little")).digest()


def rank(candidates: Sequence[Candidate], salt: int = 0) -> list[str]:
    """The candidates' keys, best first (the module's rules); sidecars that take no streams are left out.
    ``salt``: the pool's own random number, fixed for its life (rule 4's last tie-break; 0: by key)."""
    usable = [c for c in candidates if c.takes_streams and not (c.load is not None and c.load.draining)]
    reported = [c.load.capacity_slots for c in candidates if c.load is not None]
    default_capacity = float(sum(reported) / len(reported)) if reported else float(NOMINAL_CAPACITY)

    def order(candidate: Candidate) -> tuple:
        free = _free(candidate, default_capacity)
        full = free <= 0
        tier = 2 if full else (0 if candidate.local_gpu else 1)
        return (tier, utilisation(candidate, default_capacity), -free, candidate.last_chosen,
                _tie_order(candidate.key, salt))

    return [candidate.key for candidate in sorted(usable, key=order)]
