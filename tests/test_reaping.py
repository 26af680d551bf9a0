"""The reaper's policy (``sidecar/reaping.py``, CPU, no server): streams idle past the TTL; clients silent past
``client_silence_s`` (or the TTL, if shorter) taken with their streams, unless chunks of theirs are pending."""

from __future__ import annotations

from dataclasses import dataclass, field

from code2wav.sidecar.reaping import plan_reap


@dataclass
class _Stream:
    client: bytes
    stream_id: str
    last_active_s: float
    num_pending: int = 0


@dataclass
class _Client:
    last_seen_s: float
    streams: set = field(default_factory=set)


def _world(streams: list[_Stream], clients: dict[bytes, _Client]):
    for s in streams:
        clients[s.client].streams.add(s.stream_id)
    return {(s.client, s.stream_id): s for s in streams}, clients


def test_idle_streams_and_clients_past_the_ttl():
    streams, clients = _world(
        [_Stream(b"a", "old", 0.0), _Stream(b"a", "busy", 0.0, num_pending=1), _Stream(b"b", "old", 0.0),
         _Stream(b"c", "fresh", 95.0)],
        {b"a": _Client(99.0), b"b": _Client(0.0), b"c": _Client(99.0), b"d": _Client(0.0)})
    plan = plan_reap(streams, clients, now_s=100.0, ttl_s=50.0, client_silence_s=200.0)
    assert sorted((s.client, s.stream_id) for s in plan.idle_streams) == [(b"a", "old"), (b"b", "old")]  # not busy
    assert sorted(plan.gone_clients) == [b"b", b"d"]  # silent past the TTL (shorter than client_silence_s)
    assert plan


def test_a_silent_client_goes_with_its_streams_before_their_ttl():
    streams, clients = _world([_Stream(b"dead", "s1", 90.0), _Stream(b"dead", "s2", 95.0, num_pending=2),
                               _Stream(b"live", "s1", 30.0)],
                              {b"dead": _Client(30.0), b"live": _Client(99.9)})
    plan = plan_reap(streams, clients, now_s=100.0, ttl_s=600.0, client_silence_s=60.0)
    assert plan.idle_streams == []
    assert plan.gone_clients == [b"dead"]  # its streams go with it, before their TTL (busy clients: below)
    busy = plan_reap(streams, clients, now_s=100.0, ttl_s=600.0, client_silence_s=60.0, busy={b"dead": 2})
    assert not busy  # not while its chunks are queued or in the engine: their replies are still to come


def test_nothing_to_do():
    streams, clients = _world([_Stream(b"a", "s", 99.0)], {b"a": _Client(99.5)})
    assert not plan_reap(streams, clients, now_s=100.0, ttl_s=600.0, client_silence_s=60.0)
