"""What the reaper frees now: a pure function of the streams' and clients' last activity (policy; ``sessions.py``
detaches what it names and frees it in slices). Two rules:

- a stream with no chunk pending, idle for longer than ``ttl_s``, is freed;
- a client not heard from for longer than ``client_silence_s`` (not even its heartbeat ``ping``, which a live
  client sends every ``heartbeat_interval_s`` while idle), or than ``ttl_s`` if that is shorter, is gone: it is
  forgotten and its streams freed with it; not while it still has chunks queued or in the engine (``busy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Container, Mapping


@dataclass(frozen=True)
class ReapPlan:
    idle_streams: list[Any]  # streams idle past the TTL (their keys go from the session's maps)
    gone_clients: list[bytes]  # identities silent past the limit: forgotten with their streams

    def __bool__(self) -> bool:
        return bool(self.idle_streams or self.gone_clients)


def plan_reap(streams: Mapping[Any, Any], clients: Mapping[bytes, Any], now_s: float, ttl_s: float,
              client_silence_s: float, busy: Container[bytes] = ()) -> ReapPlan:
    """``streams``: key -> stream (``num_pending``, ``last_active_s``); ``clients``: identity -> client
    (``last_seen_s``); ``busy``: identities with chunks pending."""
    idle = [s for s in streams.values() if s.num_pending == 0 and now_s - s.last_active_s > ttl_s]
    silence_s = min(client_silence_s, ttl_s)
    gone = [identity for identity, client in clients.items()
            if now_s - client.last_seen_s > silence_s and identity not in busy]
    return ReapPlan(idle, gone)
