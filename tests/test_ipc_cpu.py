"""CPU tests for the policy side of CUDA IPC: slot allocation, bounds checks, region bookkeeping (deferred
close), and the client's fallback decision against a real CPU-only sidecar. The device side (opening
handles, events, two-process audio) is in test_cuda_ipc.py."""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from code2wav import proto
from code2wav.client import SidecarClient
from code2wav.client.cuda_ipc.slots import EventPool, SlotAllocator
from code2wav.proto import CudaIpcLoc, ErrorCode, TensorDesc
from code2wav.sidecar.ipc.device import OpenedRegion
from code2wav.sidecar.ipc.regions import DeviceOp, Region, RegionService, check_span
from code2wav.sidecar.metrics import Metrics
from code2wav.sidecar.models import InputSpec
from code2wav.sidecar.work import ChunkRejected

from test_server_e2e import RawPeer


def test_event_pool_never_hands_out_an_event_a_chunk_in_flight_names() -> None:
    pool = EventPool(3)
    first = pool.alloc(2)  # one message of two chunks
    second, third = pool.alloc(1), pool.alloc(1)
    assert sorted([first, second, third]) == [0, 1, 2]
    assert pool.alloc(1) is None  # every event is named by a chunk still in flight
    pool.free(second)
    assert pool.alloc(1) == second  # the only free one
    pool.free(first)
    assert pool.alloc(1) is None  # one of the first message's chunks is still unanswered
    pool.free(first)
    assert pool.alloc(1) == first
    with pytest.raises(ValueError, match="not in use"):
        pool.free(first) or pool.free(first)
    pool.free(second)
    pool.free(third)
    rng = random.Random(1)
    live: list[int] = []
    for _ in range(2000):  # whatever the order of answers, an allocated event is never named twice
        if live and rng.random() < 0.5:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            index = pool.alloc(1)
            if index is not None:
                assert index not in live
                live.append(index)


def test_slot_allocator_never_overlaps_and_coalesces() -> None:
    slots = SlotAllocator(1 << 16, align=256)
    rng = random.Random(0)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and (rng.random() < 0.5 or len(live) > 40):
            offset = rng.choice(list(live))
            slots.free(offset)
            del live[offset]
            continue
        nbytes = rng.randint(1, 5000)
        offset = slots.alloc(nbytes)
        if offset is None:
            assert sum(-(-n // 256) * 256 for n in live.values()) + nbytes > (1 << 16) // 4  # it was fairly full
            continue
        assert offset % 256 == 0 and offset + nbytes <= 1 << 16
        for other, size in live.items():
            assert offset + nbytes <= other or other + size <= offset, "overlapping slots"
        live[offset] = nbytes
    for offset in list(live):
        slots.free(offset)
    assert slots.used_nbytes == 0 and slots.alloc(1 << 16) == 0  # everything merged back into one range


def test_slot_allocator_full_and_double_free() -> None:
    slots = SlotAllocator(1024, align=256)
    offsets = [slots.alloc(256) for _ in range(4)]
    assert offsets == [0, 256, 512, 768] and slots.alloc(1) is None
    slots.free(256)
    assert slots.alloc(200) == 256
    with pytest.raises(KeyError):
        slots.free(300)


@pytest.mark.parametrize("offset, nbytes, itemsize, expected", [
    (0, 100, 4, None),
    (96, 4, 4, None),
    (97, 4, 4, "alignment"),
    (4, 100, 8, "alignment"),
    (0, 101, 1, "outside"),
    (100, 0, 4, None),
    (2**62, 8, 8, "outside"),
])
def test_check_span(offset, nbytes, itemsize, expected) -> None:
    reason = check_span(100, offset, nbytes, itemsize)
    assert (reason is None) if expected is None else (expected in reason)


class _Recorder:
    def __init__(self) -> None:
        self.sent: list = []
        self.errors: list = []

    def send(self, identity, msg) -> None:
        self.sent.append((identity, msg))

    def error(self, identity, request_id, code, message) -> None:
        self.errors.append((identity, request_id, code, message))


def _service_with_region(access: str = "read") -> tuple[RegionService, Region, _Recorder]:
    """Bookkeeping only: the 'opened' region is host memory standing in for a mapped device block."""
    rec = _Recorder()
    sessions = {b"client-a": object()}
    service = RegionService(None, "host-1", Metrics(), rec.send, rec.error, "test", session_of=sessions.get)
    service.test_sessions = sessions  # type: ignore[attr-defined]
    opened = OpenedRegion(pointer=0, nbytes=1024, data=torch.zeros(1024, dtype=torch.uint8))
    region = Region(7, b"client-a", access, 1024, opened)
    service.regions[7] = region
    return service, region, rec


def test_lookup_is_scoped_to_the_connection_and_the_access() -> None:
    service, region, _ = _service_with_region()
    desc = TensorDesc("int64", (2, 3), CudaIpcLoc(7, 64, 48))
    assert service.view(service.lookup(b"client-a", desc.loc, "read", "codes"), desc, "codes").shape == (2, 3)
    with pytest.raises(ChunkRejected) as info:
        service.lookup(b"client-b", desc.loc, "read", "codes")
    assert info.value.code == ErrorCode.NOT_FOUND
    with pytest.raises(ChunkRejected, match="registered for read, not write"):
        service.lookup(b"client-a", desc.loc, "write", "audio_out")
    with pytest.raises(ChunkRejected, match="outside the region"):
        service.view(region, TensorDesc("int64", (200,), CudaIpcLoc(7, 0, 1600)), "codes")


class _StandInEvent:
    """Stands in for a client's interprocess CUDA event, which cannot exist on a CPU machine."""

    def __init__(self, complete: bool) -> None:
        self.complete = complete
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.complete


def test_load_codes_reads_ready_chunks_defers_the_rest_and_refuses_bad_or_late_ones() -> None:
    """Window streams (their inputs kept as context on the host): the ready chunks' codes read to the host in one
    read and checked there; an exact stream's chunk gets the region's view itself, unchecked (the step copies and
    checks it on the device: ``test_poisoned_stream``)."""

    from code2wav.sidecar.ipc.io import drop_complete, incomplete_codes_events, load_codes
    from code2wav.sidecar.jobs import IpcInputs
    from code2wav.sidecar.modes import mode_for

    service, region, _ = _service_with_region()
    region.opened.events = [_StandInEvent(True), _StandInEvent(False), _StandInEvent(True)]
    region.opened.data.view(torch.int64)[:] = torch.arange(128) % 7  # codes 0..6 in the region's bytes

    def job(offset: int, event: int, arrived_s: float = 10.0, stateful: bool = False):
        desc = TensorDesc("int64", (2, 3), CudaIpcLoc(7, offset, 48))
        return SimpleNamespace(ipc_codes=IpcInputs(region, service.view(region, desc, "codes"), event),
                               arrived_s=arrived_s, codes=None, stream=SimpleNamespace(mode=mode_for(stateful)))

    ready, shared, waiting, late = job(0, 0), job(48, 0), job(96, 1), job(144, 1, arrived_s=0.0)
    inline = SimpleNamespace(ipc_codes=None)
    jobs = [ready, shared, waiting, late, inline]
    incomplete = incomplete_codes_events(jobs)
    assert incomplete == [region.opened.events[1]]  # one query per distinct event
    assert [e.queries for e in region.opened.events] == [1, 1, 0]
    refused, deferred = load_codes(jobs, InputSpec("codes", 2, 7), now_s=12.0, codes_event_timeout_s=5.0,
                                   incomplete=incomplete)
    assert [e.queries for e in region.opened.events] == [1, 1, 0]  # loading asks no event again
    assert deferred == [waiting]
    assert [(j, code) for j, code, _ in refused] == [(late, ErrorCode.DEADLINE_EXCEEDED)]
    assert "codes_event 1 of region 7 did not complete within 5s" in refused[0][2]
    assert torch.equal(ready.codes, (torch.arange(6) % 7).view(2, 3))
    assert torch.equal(shared.codes, (torch.arange(6, 12) % 7).view(2, 3))
    region.opened.events[1].complete = True  # the client's copy finished during the server's grace
    assert drop_complete(incomplete) == [] and incomplete == [] and region.opened.events[1].queries == 2
    refused, _ = load_codes([job(48, 0)], InputSpec("codes", 2, 6), now_s=12.0, codes_event_timeout_s=5.0, incomplete=[])
    assert refused[0][1] == ErrorCode.INVALID_ARGUMENT and "code 6 out of range [0, 6)" in refused[0][2]
    exact = job(48, 0, stateful=True)  # the same out-of-range codes, for an exact stream: not read, not checked here
    assert load_codes([exact], InputSpec("codes", 2, 6), now_s=12.0, codes_event_timeout_s=5.0,
                      incomplete=[]) == ([], [])
    assert exact.codes is exact.ipc_codes.view


def test_unregister_while_in_use_is_deferred_until_the_last_use_ends() -> None:
    service, region, rec = _service_with_region()
    service.acquire(region)
    service.acquire(region)
    service.on_unregister(b"client-a", proto.UnregisterRegion(11, 7))
    assert service.device_ops == [] and region.closing  # two chunks still use it
    with pytest.raises(ChunkRejected):  # new chunks may no longer name it
        service.lookup(b"client-a", CudaIpcLoc(7, 0, 8), "read", "codes")
    service.release(region)
    assert service.device_ops == []
    service.release(region)
    (op,) = service.device_ops
    assert op.kind == "close" and op.region is region and 7 not in service.regions
    service.metrics.ipc_regions.labels(access="read").inc()  # as if it had been opened
    service.op_done(op)
    assert rec.sent == [(b"client-a", proto.RegionUnregistered(11, 7))]


def test_dropping_a_client_closes_its_regions() -> None:
    service, region, _ = _service_with_region()
    service.drop_client(b"client-b")
    assert service.device_ops == []
    service.drop_client(b"client-a")
    assert [op.region for op in service.device_ops] == [region]


def test_a_region_opened_after_its_session_ended_is_closed_not_registered() -> None:
    service, _, rec = _service_with_region()
    sessions = service.test_sessions
    msg = proto.RegisterRegion(21, "GPU-1", "ab" * 64, 1024, "write")
    opened = OpenedRegion(pointer=0, nbytes=1024, data=torch.zeros(1024, dtype=torch.uint8), event_handles=("cd" * 64,))
    live = DeviceOp("open", b"client-a", message=msg, session=sessions[b"client-a"], result=opened)
    stale = DeviceOp("open", b"client-a", message=msg, session=sessions[b"client-a"], result=opened)
    service.op_done(live)
    assert isinstance(rec.sent[-1][1], proto.RegionRegistered) and len(service.regions) == 2
    sessions[b"client-a"] = object()  # the client said hello again while the second region was opening
    service.op_done(stale)
    assert len(rec.sent) == 1 and len(service.regions) == 2  # no reply to a session that is gone
    (close,) = service.device_ops
    assert close.kind == "close" and close.region.region_id not in service.regions


def test_cpu_sidecar_refuses_regions_and_the_client_falls_back(sidecar, caplog) -> None:
    with SidecarClient(sidecar.address, cuda_ipc=True) as c:
        # load: the load map's version; early_audio: understood (it never applies without CUDA IPC audio)
        assert c.server_info.capabilities == {"cuda_ipc": False, "load": 1, "early_audio": True}
        reason = c._ipc.ensure(torch.device("cuda", 0), 1.0)  # decided from the welcome: CUDA is never touched
        assert reason.startswith("sidecar_without_cuda_ipc")
        with caplog.at_level(logging.WARNING, logger="code2wav.client"):
            c._ipc.fallback(reason, 3)
            c._ipc.fallback(reason, 2)
        assert c.ipc_stats == {"inline_fallback:sidecar_without_cuda_ipc": 5}
        assert len([r for r in caplog.records if "inline instead of by CUDA IPC" in r.message]) == 1  # logged once
    peer = RawPeer(sidecar.address)
    try:
        peer.hello()
        peer.send({"type": "register_region", "request_id": 2, "gpu_uuid": "GPU-1", "ipc_handle": "00" * 64,
                   "nbytes": 4096, "access": "read", "events": ["00" * 64]})
        reply = peer.recv()
        assert isinstance(reply, proto.Error) and reply.code == ErrorCode.INVALID_ARGUMENT
        assert "no CUDA IPC" in reply.message and "send inline tensors" in reply.message
    finally:
        peer.close()
    text = sidecar.scrape()
    assert re.search(r'code2wav_sidecar_ipc_register_failures_total\{reason="unsupported"\} 1\.0', text)


class _StandInDoorbells:
    """Stands in for a read region's doorbells (``ipc.doorbells.Doorbells``: sidecar device memory, CUDA only)."""

    released = False

    def armed(self, index: int, token: int):
        from types import SimpleNamespace

        return SimpleNamespace(doorbells=self, index=index, token=token)  # as ArmedInputs names them


def test_an_armed_chunk_needs_doorbells_and_an_exact_stream_and_is_never_deferred() -> None:
    from types import SimpleNamespace

    from code2wav.sidecar.inputs import read_chunk_inputs
    from code2wav.sidecar.ipc.io import disarm_released, incomplete_codes_events, load_codes
    from code2wav.sidecar.models import load_model
    from code2wav.sidecar.modes import mode_for

    from conftest import TINY

    model = load_model(str(TINY), torch.device("cpu"), "float32")
    Q = model.num_channels
    service, region, _ = _service_with_region()
    service.device = object()  # CUDA IPC on: only its presence is looked at here
    region.opened.events = [_StandInEvent(False)]  # the codes event never completes: armed chunks do not look
    desc = TensorDesc("int64", (Q, 3), CudaIpcLoc(7, 0, Q * 3 * 8))
    chunk = proto.Chunk("s", 0, desc, codes_event=0, codes_token=6)

    def job(stateful: bool):
        return SimpleNamespace(stream=SimpleNamespace(mode=mode_for(stateful)), codes=None, audio_out=None,
                               ipc_codes=None, arrived_s=0.0)

    with pytest.raises(ChunkRejected, match="region 7 has no doorbells") as info:
        read_chunk_inputs(model, service, b"client-a", job(True), chunk, [])
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    region.opened.doorbells = _StandInDoorbells()
    with pytest.raises(ChunkRejected, match="a window stream keeps its inputs on the host"):
        read_chunk_inputs(model, service, b"client-a", job(False), chunk, [])
    armed = job(True)
    read_chunk_inputs(model, service, b"client-a", armed, chunk, [])
    assert (armed.ipc_codes.armed.index, armed.ipc_codes.armed.token) == (0, 6) and armed.codes is None
    assert incomplete_codes_events([armed]) == [] and region.opened.events[0].queries == 0
    assert load_codes([armed], model.input, now_s=100.0, codes_event_timeout_s=5.0, incomplete=[]) == ([], [])
    assert armed.codes is armed.ipc_codes.view  # [Q, 3] on the device, read by the step behind its wait
    region.opened.doorbells.released = True  # a chunk of the region was refused not ready: the region is disarmed
    late = job(True)
    read_chunk_inputs(model, service, b"client-a", late, chunk, [])
    assert late.ipc_codes.armed is None and incomplete_codes_events([late]) == [region.opened.events[0]]
    # a chunk armed before that and still queued goes by its event too (a dead client's queued chunks never park
    # another step); an inline chunk and an unarmed one are left as they are
    inline = job(True)
    assert disarm_released([armed, late, inline]) == 1
    assert armed.ipc_codes.armed is None and armed.ipc_codes.event_index == 0
    assert incomplete_codes_events([armed]) == [region.opened.events[0]] and inline.ipc_codes is None


def test_doorbell_tokens_are_even_grow_by_two_and_skip_zero_when_they_wrap() -> None:
    from code2wav.client.cuda_ipc.slots import next_token

    assert [next_token(t) for t in (0, 2, 100)] == [2, 4, 102]
    assert next_token((1 << 32) - 4) == (1 << 32) - 2
    assert next_token((1 << 32) - 2) == 2  # never 0, the words' first value
    released = 7  # the sidecar released token 6 with 7: the next token passes its cyclic >= wait
    assert next_token(6) == 8 and (next_token(6) - released) % (1 << 32) < 1 << 31


@pytest.mark.parametrize("token, before, after", [
    (6, 0, 7),  # never rung: raised to the token + 1, which ends a wait for the token and fails the gate
    (6, 4, 7),  # still holding the last chunk's token
    (6, 6, 6),  # rung in time: left alone (another client's row in the same step is still decoded)
    (6, 8, 8),  # ahead (the client's next message rang already): never lowered
    ((1 << 32) - 2, (1 << 32) - 4, (1 << 32) - 1),  # tokens past 2^31
    (2, (1 << 32) - 2, 3),  # across the wrap: 2^32 - 2 is behind 2
    (2, 3, 3),  # released already: left alone
])
def test_a_release_raises_only_a_word_behind_its_token(token, before, after, tmp_path) -> None:
    """The release is a CPU write into shared memory (no GPU queue can hold it up behind the wait it ends): the
    client's mapping of the same file sees it."""
    from code2wav.cudart.doorbell_words import DoorbellWords, raised_word

    assert raised_word(before, token) == after
    sidecar = DoorbellWords.create(64, folder=tmp_path)
    client = DoorbellWords.open(sidecar.name, 64, folder=tmp_path)
    try:
        client.words[5] = before  # as the client's stream writes it
        sidecar.raise_behind(5, token)
        assert client.words[5] == after and sidecar.words[5] == after
        assert [client.words[i] for i in range(64) if i != 5] == [0] * 63  # the other words untouched
    finally:
        client.close()
        sidecar.close()


def test_doorbell_words_are_a_private_file_the_client_maps_by_name_and_unlinks(tmp_path) -> None:
    import os
    import stat

    from code2wav.cudart.doorbell_words import DoorbellWords, is_doorbells_name

    sidecar = DoorbellWords.create(64, folder=tmp_path)
    assert is_doorbells_name(sidecar.name) and sidecar.name.split("-")[2] == str(os.getpid())
    assert stat.S_IMODE(os.stat(sidecar.path).st_mode) == 0o600  # another user cannot ring (or release) them
    assert sidecar.address % 4096 == 0 and sidecar.nbytes == 4096  # whole pages: what host registration pins
    assert [sidecar.words[i] for i in range(64)] == [0] * 64
    for bad in ("../" + sidecar.name, sidecar.name + "x", "passwd", ""):
        with pytest.raises(ValueError, match="is not a doorbell file's name"):
            DoorbellWords.open(bad, 64, folder=tmp_path)
    with pytest.raises(ValueError, match="too few for 2048 doorbell words"):
        DoorbellWords.open(sidecar.name, 2048, folder=tmp_path)
    with pytest.raises(FileNotFoundError):
        DoorbellWords.open("code2wav-doorbells-1-" + "0" * 24, 64, folder=tmp_path)
    client = DoorbellWords.open(sidecar.name, 64, folder=tmp_path)
    client.unlink()  # both processes have it mapped: nobody else can find it now
    assert not sidecar.path.exists()
    client.words[63] = (1 << 32) - 2
    assert sidecar.words[63] == (1 << 32) - 2  # one memory, two mappings
    client.close()
    sidecar.close()
    sidecar.close()  # twice: a no-op
    late = DoorbellWords.create(4, folder=tmp_path)  # a client that never mapped it: the sidecar removes the name
    late.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="num_words must be 1 to 1024"):
        DoorbellWords.create(0, folder=tmp_path)


def test_release_due_releases_only_waits_queued_long_enough_and_survives_a_failing_one(caplog) -> None:
    from code2wav.sidecar.ipc.doorbells import release_due

    class _Armed:  # stands in for ArmedInputs (whose Doorbells register their words for a GPU)
        def __init__(self, queued_s, fails: bool = False) -> None:
            self.queued_s, self.fails, self.released, self.releases = queued_s, fails, False, 0

        def release(self) -> None:
            self.releases += 1
            self.released = True
            if self.fails:
                raise RuntimeError("the device failed")

    late, failing, recent, unqueued = _Armed(1.0), _Armed(1.5, fails=True), _Armed(9.9), _Armed(None)
    waits = [("s0", 0, late), ("s1", 1, failing), ("s2", 2, recent), ("s3", 3, unqueued)]
    with caplog.at_level(logging.WARNING):
        assert release_due(waits, 0.25, 10.0, "queued armed_wait_s 0.25s ago") == 2
    assert [a.releases for a in (late, failing, recent, unqueued)] == [1, 1, 0, 0]
    assert "2 armed CUDA IPC chunk(s): queued armed_wait_s 0.25s ago (streams s0, s1)" in caplog.text
    assert "releasing the doorbell of stream s1 seq 1 failed" in caplog.text
    caplog.clear()
    assert release_due(waits, 0.25, 10.0, "again") == 2  # a second pass releases again, logs nothing new
    assert "releasing the doorbell waits" not in caplog.text
    assert release_due(waits, 0.0, float("inf"), "their step did not finish") == 3  # every queued wait


class _BlockingArmed:
    """Stands in for ArmedInputs: its release sets ``rung``, which the test's own thread blocks on, as the loop thread
    blocks in a CUDA call that waits for the device while a step is parked on its doorbell."""

    def __init__(self, queued_s: float | None) -> None:
        self.queued_s, self.released, self.releases = queued_s, False, 0
        self.rung = threading.Event()

    def release(self) -> None:
        self.releases += 1
        self.released = True
        self.rung.set()


def _armed_job(stream_id: str, armed) -> SimpleNamespace:
    return SimpleNamespace(stream=SimpleNamespace(stream_id=stream_id), seq=0, ipc_codes=SimpleNamespace(armed=armed))


def test_the_watchdog_releases_a_wait_while_the_thread_that_queued_it_is_blocked(caplog) -> None:
    from code2wav.sidecar.ipc.watchdog import DoorbellWatchdog

    dog = DoorbellWatchdog(0.05)
    parked = _BlockingArmed(time.monotonic())
    started_s = time.monotonic()
    with caplog.at_level(logging.WARNING):
        watch = dog.watch([_armed_job("dies", parked)])
        assert parked.rung.wait(10.0), "the watchdog did not release the wait"  # this thread waits, like the loop
    assert time.monotonic() - started_s >= 0.05
    assert "(streams dies)" in caplog.text
    watch.stop()
    later = _BlockingArmed(time.monotonic() - 1.0)  # due at once, but its step ended: never released by the watchdog
    ended = dog.watch([_armed_job("ended", later)])
    ended.stop()
    time.sleep(0.1)
    assert later.releases == 0
    failed = _BlockingArmed(time.monotonic() + 3600.0)  # not due for the watchdog: only the stop releases it
    dog.watch([_armed_job("failed", failed)]).stop(release=True)  # a step that did not finish: released at once
    assert failed.releases == 1
    forgotten = _BlockingArmed(time.monotonic() + 3600.0)
    dog.watch([_armed_job("forgotten", forgotten)])  # a watch nobody stopped: the close releases it
    assert dog.running
    dog.close()
    assert forgotten.releases == 1 and not dog.running
    with pytest.raises(RuntimeError, match="closed"):
        dog.watch([_armed_job("late", _BlockingArmed(None))])


def test_stop_waits_for_a_release_under_way() -> None:
    """A pass of the watchdog runs under its lock: ``stop`` returns only once a release under way has ended, so the
    caller may close the words then."""
    from code2wav.sidecar.ipc.watchdog import DoorbellWatchdog

    class _SlowArmed(_BlockingArmed):
        def __init__(self) -> None:
            super().__init__(time.monotonic() - 1.0)  # due at once
            self.entered, self.proceed = threading.Event(), threading.Event()

        def release(self) -> None:
            self.entered.set()
            self.proceed.wait(10.0)
            super().release()

    dog = DoorbellWatchdog(0.05)
    armed = _SlowArmed()
    watch = dog.watch([_armed_job("slow", armed)])
    assert armed.entered.wait(10.0)  # the watchdog is inside the release
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (watch.stop(), stopped.set()))
    stopper.start()
    assert not stopped.wait(0.2)  # the stop waits for the release under way
    armed.proceed.set()
    assert stopped.wait(10.0) and armed.releases == 1
    stopper.join(10.0)
    dog.close()
    assert armed.releases == 1  # and nothing after the stop


def test_warm_slots_cover_every_row_alignment_and_a_reset_sets_a_position() -> None:
    from code2wav.sidecar.state_store import StateArena, warm_slots

    assert [warm_slots(n, 1000) for n in (8, 4, 2, 1)] == [4, 8, 16, 32]  # row strides' common divisor, bytes
    assert warm_slots(8, 3) == 3
    arena = StateArena({"a": (5,)}, 40, torch.float32, torch.device("cpu"))  # 20-byte rows: 8 alignments
    arena.flat.fill_(1.0)
    arena.positions.fill_(9)
    arena.reset(3, 17)
    assert not arena.flat[3].any() and int(arena.positions[3]) == 17 and arena.flat[2].all()
