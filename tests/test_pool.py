"""A pool of real sidecars (``SidecarPool``): three ``serve`` processes on the tiny golden model, real ZeroMQ
sockets (ipc:// in temp dirs; loopback tcp:// behind a fake DNS name), two clients.

What it must show (issue 46): placement within +-20% of even, capacity-weighted when one sidecar has half the
slots; streams stay where they were opened; a SIGKILLed sidecar's streams end with ``StreamLost`` within the
heartbeat window while every other stream's audio is bit-identical to a run without the fault, new streams go
to the survivors, and the restarted sidecar takes new streams again; a DNS name whose records change is
followed.
"""

from __future__ import annotations

import collections
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from code2wav.client import AlreadyExists, Busy, SidecarPool, StreamLost
from code2wav.client._liveness import DEAD_AFTER_INTERVALS
from conftest import TINY
from code2wav.loadgen.spawn import SpawnedSidecar, spawn_sidecar
from test_server_e2e import _metric

TOL = 1e-5
HEARTBEAT_S = 0.5  # the sidecar's default heartbeat_interval_s
NUM_STREAMS = 90


def _start(workdir: Path, max_streams: int, *extra: str) -> SpawnedSidecar:
    workdir.mkdir(parents=True, exist_ok=True)
    return spawn_sidecar("--model", str(TINY), "--device", "cpu", "--max-streams", str(max_streams), *extra,
                         workdir=workdir)


def _started(tmp_path: Path, max_streams: list[int], addresses: list[str] | None = None) -> list[SpawnedSidecar]:
    running: list[SpawnedSidecar] = []
    try:
        for index, slots in enumerate(max_streams):
            extra = ("--address", addresses[index]) if addresses else ()
            running.append(_start(tmp_path / f"s{index}", slots, *extra))
    except BaseException:
        for sidecar in running:
            sidecar.stop()
        raise
    return running


def _open_from_two_clients(addresses: list[str], num_streams: int) -> tuple[list[SidecarPool], list]:
    """Two pools (two clients) open ``num_streams`` streams between them, at the same time."""
    pools = [SidecarPool(addresses, timeout_s=30) for _ in range(2)]
    opened: list[list] = [[], []]

    def open_all(index: int) -> None:
        for number in range(num_streams // 2):
            opened[index].append(pools[index].open_stream(f"c{index}-{number}"))

    threads = [threading.Thread(target=open_all, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [len(streams) for streams in opened] == [num_streams // 2] * 2
    return pools, [(pool, stream) for pool, streams in zip(pools, opened) for stream in streams]


def _open_streams_by_sidecar(pool: SidecarPool) -> dict[str, int]:
    """What each sidecar itself reports (a fresh ``pong``'s load), not what the pool believes."""
    pool.ping()
    return {member["address"]: member["load"].open_streams for member in pool.members}


def _chunks_decoded(sidecar: SpawnedSidecar) -> float:
    return _metric(sidecar.scrape(), "code2wav_sidecar_batch_size_sum")


@pytest.mark.parametrize("max_streams", [[40, 40, 40], [40, 40, 20]], ids=["even", "half-slots"])
def test_ninety_streams_from_two_clients_spread_by_capacity_and_stay_put(tmp_path, golden_cases, max_streams):
    running = _started(tmp_path, max_streams)
    addresses = [sidecar.address for sidecar in running]
    pools: list[SidecarPool] = []
    try:
        pools, streams = _open_from_two_clients(addresses, NUM_STREAMS)
        counts = _open_streams_by_sidecar(pools[0])
        assert sum(counts.values()) == NUM_STREAMS
        for address, slots in zip(addresses, max_streams):
            fair = NUM_STREAMS * slots / sum(max_streams)
            assert 0.8 * fair <= counts[address] <= 1.2 * fair, (counts, max_streams)
        homes = collections.Counter(pool.address_of(stream) for pool, stream in streams)
        assert homes == counts  # each pool's view is the sidecars' own
        # stickiness: three chunks per stream, batched across streams (one decode message per sidecar), all land
        # on the stream's sidecar (a chunk anywhere else would fail: no such stream there)
        codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
        before = [_chunks_decoded(sidecar) for sidecar in running]
        audio: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        for start in (0, 10, 20):
            for pool in pools:
                mine = [(index, stream) for index, (owner, stream) in enumerate(streams) if owner is pool]
                items = [(stream, codes[index % 2, :, start:start + 10]) for index, stream in mine]
                for (index, _), wav in zip(mine, pool.decode_batch(items)):
                    audio[index].append(wav)
        for index, parts in audio.items():
            expected = full[index % 2, : 30 * 48]
            assert (torch.cat(parts) - expected).abs().max().item() <= TOL
        decoded = [_chunks_decoded(sidecar) - base for sidecar, base in zip(running, before)]
        assert decoded == [3 * counts[address] for address in addresses]
    finally:
        for pool in pools:
            pool.close()
        for sidecar in running:
            sidecar.stop()


def _decode_each(pool: SidecarPool, streams: dict[str, object], codes: torch.Tensor, start: int,
                 lost: dict[str, float]) -> dict[str, torch.Tensor]:
    """One chunk per stream, one at a time (every chunk decoded alone: the same batches in every run); a
    stream whose sidecar died records when it learnt (``lost``)."""
    out = {}
    for name, stream in streams.items():
        if name in lost:
            continue
        try:
            out[name] = stream.decode(codes[int(name[1:]) % 2, :, start:start + 10])
        except StreamLost:
            lost[name] = time.monotonic()
    return out


def test_a_killed_sidecar_loses_only_its_streams_and_comes_back(tmp_path, golden_cases):
    """Without failover (``failover=False``): the streams of a dead sidecar end (tests/test_pool_failover.py has the
    default, where they move)."""
    running = _started(tmp_path, [40, 40, 40])
    addresses = [sidecar.address for sidecar in running]
    codes = golden_cases["codes"]
    pool = SidecarPool(addresses, timeout_s=30, failover=False)
    try:
        reference: dict[str, list[torch.Tensor]] = collections.defaultdict(list)  # the run without the fault
        clean = {f"r{number}": pool.open_stream(f"r{number}") for number in range(30)}
        for start in (0, 10, 20):
            for name, wav in _decode_each(pool, clean, codes, start, {}).items():
                reference["s" + name[1:]].append(wav)
        for stream in clean.values():
            stream.abort()

        streams = {f"s{number}": pool.open_stream(f"s{number}") for number in range(30)}
        victim = running[1]
        on_victim = {name for name, stream in streams.items() if pool.address_of(stream) == victim.address}
        assert len(on_victim) == 10
        audio = collections.defaultdict(list)
        for name, wav in _decode_each(pool, streams, codes, 0, {}).items():
            audio[name].append(wav)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        killed_at = time.monotonic()
        first = sorted(on_victim)[0]
        with pytest.raises(StreamLost):  # a chunk sent to the dead sidecar: failed once the heartbeats say so
            streams[first].decode(codes[0, :, 10:20])
        window_s = DEAD_AFTER_INTERVALS * HEARTBEAT_S + 2 * HEARTBEAT_S  # silence, then one more interval's slack
        assert time.monotonic() - killed_at <= window_s
        assert all(streams[name].lost for name in on_victim)  # all its streams at that moment, no other
        assert not any(stream.lost for name, stream in streams.items() if name not in on_victim)
        lost: dict[str, float] = {}
        for start in (10, 20):
            for name, wav in _decode_each(pool, streams, codes, start, lost).items():
                audio[name].append(wav)
        assert set(lost) == on_victim  # each of them says StreamLost, and only they
        survivor = next(name for name in streams if name not in on_victim)
        mixed = [(streams[first], codes[0, :, 30:40]), (streams[survivor], codes[int(survivor[1:]) % 2, :, 30:40])]
        out = pool.decode_batch(mixed, return_exceptions=True)  # two sidecars' shares, one of them gone
        assert isinstance(out[0], StreamLost) and out[1].numel() == 10 * 48  # the survivor's chunk still went
        with pytest.raises(StreamLost):
            pool.decode_batch(mixed)  # without return_exceptions: the first error, once every result is in
        for name in set(streams) - on_victim:  # untouched by the fault, to the bit
            assert all(torch.equal(a, b) for a, b in zip(audio[name], reference[name], strict=True)), name

        survivors = {pool.address_of(pool.open_stream(f"n{number}")) for number in range(12)}
        assert survivors == {running[0].address, running[2].address}

        running[1] = _start(tmp_path / "s1", 40)  # the same address, a new boot epoch
        deadline = time.monotonic() + 15
        placed_back = False
        number = 0
        while not placed_back and time.monotonic() < deadline:
            stream = pool.open_stream(f"b{number}")
            number += 1
            if pool.address_of(stream) == victim.address:
                placed_back = True
                wav = stream.decode(codes[0, :, :10])
                assert torch.equal(wav, reference["s0"][0])
            else:
                time.sleep(0.1)
        assert placed_back, pool.members
    finally:
        pool.close()
        for sidecar in running:
            sidecar.stop()


class _FakeDns:
    """A resolver whose records the test changes (a headless Service whose ready pods change)."""

    def __init__(self, records: list[str]) -> None:
        self.records = records
        self.lock = threading.Lock()

    def __call__(self, name: str) -> list[str]:
        assert name == "sidecars.test"
        with self.lock:
            return list(self.records)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_pool_behind_a_dns_name_follows_its_records(tmp_path, golden_cases):
    port = _free_port()
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # loopback addresses: one port, three sidecars, like pod IPs
    running = _started(tmp_path, [40, 40, 40], [f"tcp://{host}:{port}" for host in hosts])
    dns = _FakeDns(hosts[:2])
    pool = SidecarPool(f"dns://sidecars.test:{port}", resolver=dns, resolve_interval_s=0.2, timeout_s=30)
    codes = golden_cases["codes"]
    try:
        first = [pool.open_stream(f"a{number}") for number in range(6)]
        assert {pool.address_of(s) for s in first} == {f"tcp://{host}:{port}" for host in hosts[:2]}
        with dns.lock:
            dns.records = hosts[1:]
        time.sleep(1.0)  # a few re-resolutions
        later = [pool.open_stream(f"b{number}") for number in range(6)]
        assert {pool.address_of(s) for s in later} == {f"tcp://{host}:{port}" for host in hosts[1:]}
        old = first[0] if pool.address_of(first[0]).startswith("tcp://127.0.0.1:") else first[1]
        assert pool.address_of(old) == f"tcp://127.0.0.1:{port}"
        full = golden_cases["full"][0, 0]
        assert (old.decode(codes[0, :, :10]) - full[:480]).abs().max().item() <= TOL  # it stays where it was
        for stream in first:
            stream.abort()
        time.sleep(1.0)
        assert f"tcp://127.0.0.1:{port}" not in {member["address"] for member in pool.members}  # let go when idle
    finally:
        pool.close()
        for sidecar in running:
            sidecar.stop()


def test_busy_from_one_sidecar_is_tried_on_the_next_before_the_caller_sees_it(tmp_path):
    """A report that is stale (another client filled the sidecar since): its ``busy`` answer sends the stream to
    the next sidecar; only when every one is full does the caller get ``Busy``."""
    small, large = _started(tmp_path, [2, 3])
    other = SidecarPool(small.address, timeout_s=30)  # another client
    pool = SidecarPool([small.address, large.address], timeout_s=30, refresh_s=60.0)  # reports from the welcome only
    try:
        filled = [other.open_stream(f"other-{number}") for number in range(2)]  # small is full now
        placed = [pool.open_stream(f"s{number}") for number in range(3)]
        assert [pool.address_of(stream) for stream in placed] == [large.address] * 3
        assert _metric(small.scrape(), "code2wav_sidecar_errors_total") >= 1  # it was asked, and said busy
        assert 'code="busy"' in small.scrape()
        with pytest.raises(Busy):
            pool.open_stream("one-too-many")  # both full: now the caller sees it
        with pytest.raises(AlreadyExists):
            pool.open_stream("s0")  # live in this pool, on whichever sidecar: refused as one client refuses it
        assert len(filled) == 2
    finally:
        pool.close()
        other.close()
        small.stop()
        large.stop()
