"""The pool's placement policy and address forms, without sockets (``client/placement.py``,
``client/discovery.py``); the processes' side is ``test_pool.py``."""

from __future__ import annotations

import collections

import pytest

from code2wav.client import errors as cerr
from code2wav.client.discovery import PoolAddress, parse_pool_address
from code2wav.client.placement import Candidate, rank
from code2wav.proto import Load


def _load(open_streams: int, free_slots: int, draining: bool = False) -> Load:
    return Load(open_streams=open_streams, free_slots=free_slots, queued_chunks=0, step_s=0.0, draining=draining)


def _place(capacities: dict[str, int], num_streams: int, local: str | None = None) -> collections.Counter:
    """Place ``num_streams`` one by one with reports that never refresh (the worst case: all from the counts
    placed since the welcome), as the pool does; returns streams per sidecar."""
    placed: collections.Counter = collections.Counter()
    last: dict[str, int] = {}
    clock = 0
    for _ in range(num_streams):
        candidates = [Candidate(key, True, _load(0, capacity), placed[key], key == local, last.get(key, 0))
                      for key, capacity in capacities.items()]
        best = rank(candidates)[0]
        placed[best] += 1
        clock += 1
        last[best] = clock
    return placed


def test_equal_sidecars_get_equal_shares_and_ties_go_round_robin():
    assert _place({"a": 40, "b": 40, "c": 40}, 45) == {"a": 15, "b": 15, "c": 15}


def test_shares_follow_capacity():
    assert _place({"a": 40, "b": 40, "c": 20}, 50) == {"a": 20, "b": 20, "c": 10}


def test_the_callers_gpu_comes_first_until_it_is_full_then_others_take_the_overflow():
    placed = _place({"a": 10, "local": 10, "c": 10}, 16, local="local")
    assert placed == {"local": 10, "a": 3, "c": 3}


def test_reported_load_counts_and_unusable_sidecars_are_left_out():
    busy = Candidate("busy", True, _load(30, 10), 0, False)
    idle = Candidate("idle", True, _load(5, 35), 0, False)
    assert rank([busy, idle]) == ["idle", "busy"]
    assert rank([busy, Candidate("idle", False, _load(0, 40), 0, False)]) == ["busy"]  # not answering
    assert rank([busy, Candidate("draining", True, _load(0, 40, draining=True), 0, False)]) == ["busy"]
    full = Candidate("full", True, _load(40, 0), 0, True)
    assert rank([full, busy]) == ["busy", "full"]  # a full sidecar (local or not) is the last resort


def test_a_sidecar_without_load_reports_counts_this_pools_streams():
    old = Candidate("old", True, None, 0, False, open_here=10)
    new = Candidate("new", True, _load(0, 40), 0, False)
    assert rank([old, new]) == ["new", "old"]
    assert rank([Candidate("old", True, None, 0, False, open_here=0),
                 Candidate("new", True, _load(30, 10), 0, False)]) == ["old", "new"]


def test_pools_with_their_own_salts_break_a_tie_between_idle_sidecars_differently():
    idle = [Candidate(key, True, _load(0, 40), 0, False) for key in ("a", "b", "c")]
    assert rank(idle) == ["a", "b", "c"]  # salt 0: by key
    firsts = collections.Counter(rank(idle, salt=salt)[0] for salt in range(1, 301))
    assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) >= 60, firsts  # about 100 each
    assert rank(idle, salt=7) == rank(idle, salt=7)  # one pool's order is fixed
    busier = [Candidate("a", True, _load(1, 39), 0, False), *idle[1:]]  # no tie: the salt does not matter
    assert {rank(busier, salt=salt)[-1] for salt in range(1, 50)} == {"a"}


def test_pool_addresses():
    assert parse_pool_address("ipc:///a.sock") == PoolAddress(addresses=("ipc:///a.sock",))
    assert parse_pool_address("ipc:///a.sock, tcp://10.0.0.2:5555").addresses == ("ipc:///a.sock",
                                                                                  "tcp://10.0.0.2:5555")
    assert parse_pool_address(["tcp://h:1", "tcp://h:2"]).addresses == ("tcp://h:1", "tcp://h:2")
    dns = parse_pool_address("dns://code2wav-sidecar.tts.svc:5555")
    assert (dns.name, dns.port) == ("code2wav-sidecar.tts.svc", 5555)
    assert dns.resolve(lambda name: ["10.0.0.3", "10.0.0.2", "fd00::1"]) == [
        "tcp://10.0.0.2:5555", "tcp://10.0.0.3:5555", "tcp://[fd00::1]:5555"]
    for bad, match in [("", "at least one"), ("dns://x", "NAME:PORT"), ("dns://x:1,tcp://h:1", "stands alone"),
                       ("http://x", "ipc://"), ("ipc:///a,ipc:///a", "once")]:
        with pytest.raises(cerr.InvalidArgument, match=match):
            parse_pool_address(bad)
