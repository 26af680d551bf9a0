"""What the reaper frees now: a pure function of the streams' and clients' last activity (policy; ``sessions.py``
detaches what it names and frees it in slices). Rules:

- a stream with no chunk pending, idle for longer than ``ttl_s``, is freed;
- a client not heard from for longer than ``ttl_s`` whose streams are all freed is forgotten (``ttl``);
- a client not heard from for longer than ``client_silence_s`` (not even its heartbeat ``ping``, which a live
  client sends every ``heartbeat_interval_s`` while idle) is gone: it is forgotten and its streams freed with it,
  before their TTL (``silent``); not while it still has chunks queued or in the engine (``busy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Container, Mapping


@dataclass(frozen=True)
class ReapPlan:
    idle_streams: list[Any]  # streams idle past the TTL (their keys go from the session's maps)
    gone_clients: list[bytes]  # identities silent past the TTL with no stream left: forgotten
    silent_clients: list[bytes]  # identities silent past client_silence_s: forgotten with their streams

    def __bool__(self) -> bool:
        return bool(self.idle_streams or self.gone_clients or self.silent_clients)


def plan_reap(streams: Mapping[Any, Any], clients: Mapping[bytes, Any], now_s: float, ttl_s: float,
              client_silence_s: float, busy: Container[bytes] = ()) -> ReapPlan:
    """``streams``: key -> stream (``client``, ``stream_id``, ``num_pending``, ``last_active_s``); ``clients``:
    identity -> client (``streams``: its stream ids, ``last_seen_s``); ``busy``: identities with chunks pending."""
    idle = [s for s in streams.values() if s.num_pending == 0 and now_s - s.last_active_s > ttl_s]
    idle_ids: dict[bytes, set[str]] = {}
    for stream in idle:
        idle_ids.setdefault(stream.client, set()).add(stream.stream_id)
    gone, silent = [], []
    for identity, client in clients.items():
        quiet_s = now_s - client.last_seen_s
        if quiet_s > ttl_s and not (client.streams - idle_ids.get(identity, set())):
            gone.append(identity)
        elif quiet_s > client_silence_s and identity not in busy:
            silent.append(identity)
    return ReapPlan(idle, gone, silent)
