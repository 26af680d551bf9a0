"""CPU tests of pure policy pieces: scheduler batching, state arena bookkeeping, config validation, seq rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from code2wav.sidecar.config import ConfigError, load_config
from code2wav.sidecar.jobs import ChunkJob, IpcInputs
from code2wav.sidecar.scheduler import BatchPolicy, Scheduler, batch_policy
from code2wav.sidecar.state_store import ArenaFull, StateArena
from code2wav.sidecar.streams import SeqVerdict, ServedStream, check_seq


def _stream(name: str, mode: str = "exact", model: str = "m") -> ServedStream:
    return ServedStream(client=b"c", stream_id=name, model=model, mode=mode, left_context_frames=0, slot=0,
                  last_active_s=0.0)


def _job(stream: ServedStream, seq: int = 0, arrived_s: float = 0.0) -> ChunkJob:
    return ChunkJob(stream=stream, seq=seq, codes=None, context_frames=0, final=False, arrived_s=arrived_s,
                    reply=None, index=0)


def test_batch_is_fifo_one_key_one_chunk_per_stream():
    sched = Scheduler(BatchPolicy(max_batch_size=3, batch_window_s=0.001, max_pending_chunks=100))
    a, b, w, c = _stream("a"), _stream("b"), _stream("w", mode="window"), _stream("c")
    jobs = [_job(a, 0), _job(a, 1), _job(w, 0), _job(b, 0), _job(c, 0), _job(b, 1)]
    for j in jobs:
        assert sched.submit(j)
    first = sched.take_batch()
    assert [(j.stream.stream_id, j.seq) for j in first] == [("a", 0), ("b", 0), ("c", 0)]
    second = sched.take_batch()  # the oldest left is a/1: exact again; window waits behind it, no starvation
    assert [(j.stream.stream_id, j.seq) for j in second] == [("a", 1), ("b", 1)]
    third = sched.take_batch()
    assert [(j.stream.stream_id, j.seq) for j in third] == [("w", 0)]
    assert sched.take_batch() == [] and len(sched) == 0


def test_decoded_frames_count_a_window_streams_kept_context_and_read_ipc_shapes():
    """What the server's loop-or-worker policy dispatches on: the frames the engine will decode per chunk."""
    exact, window = _stream("e"), _stream("w", mode="window")
    inline = _job(exact)
    inline.codes = torch.zeros((4, 7), dtype=torch.long)
    assert inline.decoded_frames == 7
    ipc = _job(window)  # codes still in a CUDA IPC region: only the view's shape is known
    ipc.ipc_codes = IpcInputs(None, torch.zeros((4, 25), dtype=torch.int32), 0)
    assert ipc.decoded_frames == 25
    window.context_codes = torch.zeros((4, 3), dtype=torch.long)  # kept left context, joined in front
    assert ipc.decoded_frames == 28
    exact.context_codes = torch.zeros((4, 3), dtype=torch.long)  # ignored outside window mode
    assert inline.decoded_frames == 7


def test_queue_bound_and_window():
    sched = Scheduler(BatchPolicy(max_batch_size=2, batch_window_s=0.010, max_pending_chunks=2))
    s = _stream("a")
    assert sched.seconds_until_ready(0.0) is None
    assert sched.submit(_job(s, 0, arrived_s=1.0))
    assert sched.seconds_until_ready(1.004) == pytest.approx(0.006)
    assert sched.seconds_until_ready(1.5) == 0.0
    assert sched.submit(_job(_stream("b"), 0, arrived_s=1.0))
    assert sched.seconds_until_ready(1.0) == 0.0  # full batch: no waiting
    assert not sched.submit(_job(_stream("c"), 0))  # bounded: the caller answers busy


def test_window_is_skipped_when_no_other_open_stream_can_join():
    sched = Scheduler(BatchPolicy(max_batch_size=8, batch_window_s=0.010, max_pending_chunks=100))
    a, b = _stream("a"), _stream("b")
    sched.submit(_job(a, 0, arrived_s=1.0))
    assert sched.seconds_until_ready(1.0, num_open_streams=1) == 0.0  # one stream alone: nobody to wait for
    assert sched.seconds_until_ready(1.0, num_open_streams=2) == pytest.approx(0.010)  # b may still send
    assert sched.seconds_until_ready(1.0) == pytest.approx(0.010)  # count unknown: the window as before
    sched.submit(_job(a, 1, arrived_s=1.001))  # a's next chunk cannot join a's batch: b still may
    assert sched.seconds_until_ready(1.002, num_open_streams=2) == pytest.approx(0.008)
    sched.submit(_job(b, 0, arrived_s=1.002))
    assert sched.seconds_until_ready(1.002, num_open_streams=2) == 0.0
    assert [(j.stream.stream_id, j.seq) for j in sched.take_batch()] == [("a", 0), ("b", 0)]
    # left: a/1 alone; b (its chunk taken) may send its next one
    assert sched.seconds_until_ready(1.003, num_open_streams=2) == pytest.approx(0.008)
    sched.requeue([_job(b, 1, arrived_s=1.003)])  # put back (its inputs were not ready): counted again
    assert sched.seconds_until_ready(1.003, num_open_streams=2) == 0.0
    assert len(sched.remove_stream(b)) == 1  # b aborted: its chunk no longer counts
    assert sched.seconds_until_ready(1.003, num_open_streams=2) == pytest.approx(0.008)
    sched.take_batch()
    assert sched.seconds_until_ready(1.003, num_open_streams=0) is None


def test_batch_policy_caps_batches_to_the_captured_graphs_and_drain_skips_the_window():
    assert batch_policy(64, 200, 4096) == BatchPolicy(64, 0.0002, 4096)  # no graphs: as configured
    assert batch_policy(64, 200, 4096, largest_graph_batch=16).max_batch_size == 16  # never an eager batch
    assert batch_policy(8, 200, 4096, largest_graph_batch=16).max_batch_size == 8
    sched = Scheduler(batch_policy(8, 10_000, 100))
    sched.submit(_job(_stream("a"), 0, arrived_s=1.0))
    assert sched.seconds_until_ready(1.0, num_open_streams=2) == pytest.approx(0.010)
    sched.draining = True  # stopping: what is queued runs now
    assert sched.seconds_until_ready(1.0, num_open_streams=2) == 0.0


def test_remove_stream_keeps_others_in_order():
    sched = Scheduler(BatchPolicy(4, 0.0, 10))
    a, b = _stream("a"), _stream("b")
    for j in [_job(a, 0), _job(b, 0), _job(a, 1), _job(b, 1)]:
        sched.submit(j)
    dropped = sched.remove_stream(a)
    assert [j.seq for j in dropped] == [0, 1]
    assert [(j.stream.stream_id, j.seq) for j in sched.take_batch()] == [("b", 0)]


def test_streams_in_a_step_in_flight_wait_for_it_and_count_for_nothing():
    """The step launched last still runs: its streams (busy) keep their queued chunks; the rest batch without them."""
    sched = Scheduler(BatchPolicy(max_batch_size=2, batch_window_s=0.010, max_pending_chunks=100))
    a, b, c = _stream("a"), _stream("b"), _stream("c")
    sched.submit(_job(a, 1, arrived_s=1.000))  # a/0 and b/0 are in the step in flight
    sched.submit(_job(b, 1, arrived_s=1.001))
    busy = {id(a), id(b)}
    assert sched.seconds_until_ready(1.002, num_open_streams=3, busy=busy) is None  # nothing may run yet
    assert sched.take_batch(busy) == [] and len(sched) == 2
    sched.submit(_job(c, 0, arrived_s=1.003))
    # two queued (a full batch of 2) but only c may run: the window, from c's arrival, not a's
    assert sched.seconds_until_ready(1.004, num_open_streams=4, busy=busy) == pytest.approx(0.009)
    # every open stream is queued or busy: nobody else can join, c runs now
    assert sched.seconds_until_ready(1.004, num_open_streams=3, busy=busy) == 0.0
    assert [(j.stream.stream_id, j.seq) for j in sched.take_batch(busy)] == [("c", 0)]
    # the step finished: a and b are free again, FIFO as always
    assert sched.seconds_until_ready(1.004, num_open_streams=3) == 0.0  # a full batch
    assert [(j.stream.stream_id, j.seq) for j in sched.take_batch()] == [("a", 1), ("b", 1)]


def test_long_chunks_batch_apart_from_those_a_graph_serves():
    """A failover's history replay (hundreds of frames) must not pull the chunks a graph serves into an eager step."""
    from code2wav.sidecar.modes import mode_for  # noqa: PLC0415

    sched = Scheduler(batch_policy(8, 0, 100, graph_frames={"exact": 25, "window": 50}))
    exact = mode_for(True)
    streams = [_stream(name) for name in "abcde"]
    for stream in streams:
        stream.mode = exact
    lengths = {"a": 25, "b": 605, "c": 1, "d": 580, "e": 26}
    for stream in streams:
        sched.submit(dataclasses.replace(_job(stream), codes=torch.zeros(16, lengths[stream.stream_id])))
    assert [j.stream.stream_id for j in sched.take_batch()] == ["a", "c"]  # the oldest is short: the short ones
    assert [j.stream.stream_id for j in sched.take_batch()] == ["b", "d", "e"]  # then the long ones, 26 is long
    assert sched.take_batch() == []
    assert not batch_policy(8, 0, 100).is_long("exact", 10_000)  # no graphs: no split


def test_replays_queued_at_once_let_live_chunks_through_every_other_step():
    """A mass failover queues many long replays at once; a live chunk behind them waits for one long step, not all
    of them, and the replays still run every other step (neither kind starves)."""
    from code2wav.sidecar.modes import mode_for  # noqa: PLC0415

    sched = Scheduler(batch_policy(2, 0, 100, graph_frames={"exact": 25}))
    exact = mode_for(True)

    def submit(name: str, num_frames: int) -> None:
        stream = _stream(name)
        stream.mode = exact
        assert sched.submit(dataclasses.replace(_job(stream), codes=torch.zeros(16, num_frames)))

    for name in ("r1", "r2", "r3", "r4", "r5", "r6"):  # six replays of 580 frames, queued first
        submit(name, 580)
    submit("live1", 25)
    submit("live2", 25)
    submit("live3", 25)
    order = []
    while batch := sched.take_batch():
        order.append([j.stream.stream_id for j in batch])
    # FIFO alone would run r1..r6 (three long steps) before live1; here a short batch follows each long one
    assert order == [["r1", "r2"], ["live1", "live2"], ["r3", "r4"], ["live3"], ["r5", "r6"]]
    for name in ("r7", "r8"):  # nothing short queued: long batches run back to back
        submit(name, 580)
    submit("r9", 600)
    assert [j.stream.stream_id for j in sched.take_batch()] == ["r7", "r8"]
    assert [j.stream.stream_id for j in sched.take_batch()] == ["r9"]


def test_a_streams_chunks_run_in_order_when_its_first_is_long():
    """A moved stream's replay (long, eager) and its live chunk right behind it (short, a graph's): the live chunk
    must not join a short batch while the replay waits (it would decode against a state the replay has not built;
    the 2026-12-06 GPU failover soak's one stream at 8.8 dB)."""
    from code2wav.sidecar.modes import mode_for  # noqa: PLC0415

    sched = Scheduler(batch_policy(4, 0, 100, graph_frames={"exact": 25}))
    exact = mode_for(True)
    y, x = _stream("y"), _stream("x")
    for stream in (y, x):
        stream.mode = exact
    for stream, seq, num_frames in ((y, 0, 25), (x, 0, 580), (x, 1, 25), (y, 1, 25)):
        assert sched.submit(dataclasses.replace(_job(stream, seq), codes=torch.zeros(16, num_frames)))
    taken = []
    while batch := sched.take_batch():
        taken.append([(j.stream.stream_id, j.seq) for j in batch])
    assert taken == [[("y", 0)], [("x", 0)], [("x", 1), ("y", 1)]]
    # after a long batch the short seed is a stream's first queued chunk, never one behind its own replay
    for stream, seq, num_frames in ((x, 2, 580), (y, 2, 580), (x, 3, 25), (y, 3, 600)):
        assert sched.submit(dataclasses.replace(_job(stream, seq), codes=torch.zeros(16, num_frames)))
    taken = []
    while batch := sched.take_batch():
        taken.append([(j.stream.stream_id, j.seq) for j in batch])
    assert taken == [[("x", 2), ("y", 2)], [("x", 3)], [("y", 3)]]


def test_arena_slots_scratch_and_reuse():
    arena = StateArena({"x": (2, 3)}, num_slots=2, dtype=torch.float32, device=torch.device("cpu"))
    assert arena.bytes_per_stream == 6 * 4 + 8
    s0, s1 = arena.allocate(), arena.allocate()
    assert {s0, s1} == {0, 1} and arena.scratch_slot == 2
    with pytest.raises(ArenaFull):
        arena.allocate()
    slots = torch.tensor([s0, arena.scratch_slot])  # a real row and a padding row
    arena.scatter(slots, {"x": torch.ones(2, 2, 3)}, torch.tensor([5, 9]))
    assert arena.positions.tolist() == [5, 0, 9]
    assert arena.tensors["x"][s1].abs().sum() == 0  # the other stream's slot untouched
    state, pos = arena.gather(torch.tensor([s0]))
    assert torch.equal(state["x"][0], torch.ones(2, 3)) and pos.tolist() == [5]
    with pytest.raises(ValueError, match="'x': expected shape"):  # same size per row, wrong shape: refused
        arena.scatter(slots, {"x": torch.ones(2, 3, 2)}, torch.tensor([5, 9]))
    arena.release(s0)
    again = arena.allocate()
    assert again == s0 and arena.positions[again] == 0 and arena.tensors["x"][again].abs().sum() == 0
    with pytest.raises(ValueError):
        arena.release(arena.scratch_slot)


def test_seq_rules():
    s = _stream("a")
    assert check_seq(s, 0)[0] == SeqVerdict.ACCEPT
    assert check_seq(s, 1)[0] == "refuse"
    s.next_seq, s.committed_seq, s.last_audio = 1, 0, torch.zeros(1)
    assert check_seq(s, 0)[0] == SeqVerdict.RESEND
    s.num_pending, s.next_seq = 1, 2
    verdict, reason = check_seq(s, 1)
    assert verdict == "refuse" and "still being decoded" in reason
    assert check_seq(s, 0)[0] == "refuse"  # no resend while a later chunk is in flight


def test_config_rejects_unknown_keys_with_hint(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  max_batch: 8\n")
    with pytest.raises(ConfigError, match=r"unknown key 'scheduler.max_batch' \(did you mean 'max_batch_size'\?\)"):
        load_config(path)
    path.write_text("streams:\n  ttl_s: -1\n")
    with pytest.raises(ConfigError, match="streams.ttl_s"):
        load_config(path)
    path.write_text("dtype: bfloat16\nscheduler:\n  max_batch_size: 8\n")
    cfg = load_config(path, {"metrics_port": 0})
    assert cfg.dtype == "bfloat16" and cfg.scheduler.max_batch_size == 8 and cfg.metrics_port == 0


def test_cpu_threads_are_one_on_cuda_and_torchs_default_on_cpu_unless_set(tmp_path):
    from code2wav.sidecar.config import cpu_threads

    cfg = load_config()
    assert cfg.cpu_threads == "auto"
    assert cpu_threads(cfg, "cuda") == 1 and cpu_threads(cfg, "cpu") is None
    path = tmp_path / "c.yaml"
    path.write_text("cpu_threads: 4\n")
    assert cpu_threads(load_config(path), "cuda") == 4 and cpu_threads(load_config(path), "cpu") == 4
    for bad in ("0", "many"):
        path.write_text(f"cpu_threads: {bad}\n")
        with pytest.raises(ConfigError, match="cpu_threads"):
            load_config(path)


def test_busy_poll_setting_resolves_per_device_and_rejects_bad_values(tmp_path):
    from code2wav.sidecar.config import AUTO_BUSY_POLL_US, busy_poll_s

    cfg = load_config()
    assert cfg.busy_poll_us == "auto"
    assert busy_poll_s(cfg, "cuda") == AUTO_BUSY_POLL_US / 1e6 and busy_poll_s(cfg, "cpu") == 0.0
    path = tmp_path / "c.yaml"
    path.write_text("busy_poll_us: 500\n")
    assert busy_poll_s(load_config(path), "cpu") == 500e-6  # an explicit value holds on any device
    path.write_text("busy_poll_us: 0\n")
    assert busy_poll_s(load_config(path), "cuda") == 0.0
    for bad in ("-1", "fast"):
        path.write_text(f"busy_poll_us: {bad}\n")
        with pytest.raises(ConfigError, match="busy_poll_us"):
            load_config(path)
