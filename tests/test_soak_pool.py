"""Faults across a pool, short CPU version (issue 47, item 6): loadgen/soak.py with three sidecars of the tiny
model, three client processes each a ``SidecarPool`` over them, sidecar 1 SIGKILLed at 12 s and started again at
32 s. What it must show: the survivors decode every chunk sent to them (0 lost, 0 failed), the killed sidecar's
chunks in flight end with ``stream_lost`` (counted apart), new streams go to the survivors while it is down and to
it again once it is back, the survivors' p99 is back under its bound within 10 s of the kill, and every recorded
stream's audio equals the same codes decoded again alone, within 2e-5 (float32: the exact mode's 1e-5, doubled for moved streams' replays; batch company
changes the order of some float sums, so not every chunk is bit-identical: the report counts those that are).
The GPU run is ``.ci/gpu-phases/soak-pool``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from code2wav.loadgen.soak_pool_report import RECOVERY_LIMIT_S
from code2wav.loadgen.soak_summary import summary_lines
from conftest import ROOT, TINY, start_sidecar

KILL_T_S, RESTART_T_S = 12.0, 32.0


@pytest.mark.slow
@pytest.mark.parametrize("failover", [False, True])
def test_a_sidecar_killed_under_a_pool_soak_costs_the_others_nothing(tmp_path, failover):
    """Without failover (``--no-failover``) the killed sidecar's chunks in flight end with ``stream_lost``; with it
    (the pools' default) its streams move to the survivors and every chunk completes, the moved streams' audio
    within the same tolerance of a decode alone (they are checked whole: no chunk without audio)."""
    out, work = tmp_path / "soak.json", tmp_path / "work"
    cmd = [sys.executable, "-m", "code2wav.loadgen.soak", "--model", str(TINY), "--device", "cpu",
           "--dtype", "float32", "--duration-s", "46", "--clients", "3", "--streams-per-client", "2",
           "--frame-rate-hz", "50", "--chunk-frames", "10", "--stream-frames", "150", "--kill-every-s", "0",
           "--timeout-s", "5", "--sidecars", "3", "--kill-sidecar-at-s", str(KILL_T_S), "--restart-killed-at-s",
           str(RESTART_T_S), "--check-slots", "2", "--sidecar-arg=--max-streams", "--sidecar-arg=64",
           "--workdir", str(work), "--out", str(out), *([] if failover else ["--no-failover"]),
           # a moved exact stream's state is rebuilt by one replay chunk, other rounding than its chunks: a CI run
           # saw 1.15e-05 at 105 dB on one (float32; a wrong state is near 0 dB), so 2e-5, not the default 1e-5
           "--check-atol", "2e-5"]
    # one torch thread per process: three sidecars and three clients share this machine's cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    pool = report["pool"]
    print("\n" + "\n".join(summary_lines(report, min_chunks=10, every_s=10)))
    assert pool["killed_sidecar"] == 1 and KILL_T_S <= pool["kill_t_s"] < KILL_T_S + 1
    assert RESTART_T_S <= pool["restart"]["t_s"] < pool["restart"]["ready_t_s"] < report["duration_s"]
    survivors = [pool["by_sidecar"][0], pool["by_sidecar"][2]]
    for counts in survivors:  # every chunk sent to a survivor decoded, before, during and after the kill
        assert counts["sent"] > 100 and counts["decoded"] == counts["sent"], pool["by_sidecar"]
        assert counts["failed"] == {} and counts["lost"] == 0 and counts["bad_audio"] == 0
    killed = pool["by_sidecar"][1]
    assert set(killed["failed"]) <= {"stream_lost"} and killed["lost"] == 0, killed  # typed, never lost
    assert killed["decoded"] + killed["failed"].get("stream_lost", 0) == killed["sent"]
    if failover:  # moved, not lost: every chunk sent to the killed sidecar completed on another one
        moved = pool["failover"]
        assert killed["failed"] == {} and moved["streams_lost"] == 0 and moved["moves_after_kill"] >= 1, moved
        assert moved["replay_frames"] > 0 and 0 < moved["recovery_s"]["max"] < 10, moved
        assert moved["p99_ms"]["before"] is not None, moved
    else:
        assert pool["failover"] is None
    assert report["lost"] == 0 and report["crashed_clients"] == [] and report["all_survivors_exited"]
    placed = pool["placements"]
    assert all(count > 0 for count in placed["before_kill"]), placed  # all three took streams
    assert placed["after_kill"][1] == 0 and placed["after_kill"][0] > 0 and placed["after_kill"][2] > 0, placed
    assert placed["after_restart"][1] > 0, placed  # the restarted one takes new streams again
    recovery = pool["p99_recovery"]
    assert recovery["baseline_p99_ms"] > 0 and [w["start_s"] for w in recovery["windows"]] == [0.0, 10.0], recovery
    assert recovery["recovered_after_s"] <= RECOVERY_LIMIT_S, recovery
    check = pool["audio_check"]
    assert check["atol"] == 2e-5 and check["min_snr_db"] is None  # float32 on CPU: judged by the largest difference
    assert check["within_tolerance"] and check["incomplete_on_survivors"] == []
    assert check["survivors_open_across_kill"]["streams"] >= 1 and check["killed_up_to_kill"]["streams"] >= 1
    assert check["restarted"]["streams"] >= 1
    assert check["survivors"]["chunks_compared"] > 200 and check["survivors"]["max_abs_diff"] <= 2e-5
    # the check compares audio, not shapes: a recorded chunk changed by 1e-4 is found, and only that one
    recorded = sorted(work.glob("client*.check.pt"))
    assert len(recorded) == 3
    records = torch.load(recorded[0], weights_only=False)
    victim = next(r for r in records if r["sidecar"] != 1 and r["audio"] and r["audio"][0] is not None)
    victim["audio"][0][7] += 1e-4
    torch.save([victim], tmp_path / "changed.check.pt")
    (tmp_path / "ref").mkdir()
    reference = start_sidecar(tmp_path / "ref")
    try:
        subprocess.run([sys.executable, "-m", "code2wav.loadgen.soak_check", "--address", reference.address,
                        "--alive", "0", "--out", str(tmp_path / "changed.json"), str(tmp_path / "changed.check.pt")],
                       cwd=ROOT, check=True, timeout=120, env=env)
    finally:
        reference.stop()
    (result,) = json.loads((tmp_path / "changed.json").read_text())
    assert 1e-4 - 1e-5 <= result["max_abs_diff"] <= 1e-4 + 1e-5, result
    assert 30.0 < result["min_snr_db"] < 120.0, result  # one sample off by 1e-4: a finite ratio, however high
    assert result["chunks_compared"] == len(victim["codes"]) and result["reference_sidecar"] == 0
    assert pool["verdict"] == {mark: True for mark in pool["verdict"]} and len(pool["verdict"]) == 8 + failover
    assert done.returncode == 0, done.stderr[-3000:]
    lines = summary_lines(report, min_chunks=10)
    assert lines[-1].startswith("PASS ") and any(line.startswith("new streams by sidecar: ") for line in lines)


def test_the_pool_verdict_fails_on_each_fault_it_judges():
    """The marks from synthetic outcomes: a survivor's failed or lost chunk, a stream placed on the killed sidecar
    while it was down, a survivors' p99 still high 10 s after the kill, audio out of tolerance: each one fails."""
    from code2wav.loadgen.soak_pool_report import audio_check, p99_recovery, verdict

    t0 = 1000.0  # wall time of the soak's start; the kill at 30 s
    steady = [[t0 + t / 10, 0.010, t % 3] for t in range(0, 600)]  # 10 ms every 0.1 s over 60 s, on all three
    slow_until = [[t0 + 30 + t / 10, 0.200, 0] for t in range(0, 150)]  # sidecar 0 at 200 ms for 15 s after it
    quick = p99_recovery(steady, t0, killed=1, kill_t_s=30.0, until_t_s=60.0)
    assert quick["baseline_p99_ms"] == 10.0 and quick["bound_ms"] == 35.0 and quick["recovered_after_s"] == 0.0
    late = p99_recovery(steady + slow_until, t0, killed=1, kill_t_s=30.0, until_t_s=60.0)
    assert late["recovered_after_s"] == 20.0  # the window 10-20 s after the kill is still over the bound
    # the killed sidecar's chunks do not count: 200 ms there changes nothing
    assert p99_recovery(steady + [[t0 + 45, 0.2, 1]] * 50, t0, 1, 30.0, 60.0)["recovered_after_s"] == 0.0

    def outcome(**over) -> dict:
        return {"sent": 10, "decoded": 10, "bad_audio": 0, "failed": {}, "lost": 0, **over}

    record = {"stream_id": "s", "sidecar": 0, "t_open": t0 + 20, "t_last_sent": t0 + 40, "chunks_sent": 5,
              "chunks_compared": 5, "bit_identical_chunks": 4, "max_abs_diff": 5e-6, "min_snr_db": 100.0}
    good = {"killed_sidecar": 1, "by_sidecar": [outcome(), outcome(decoded=8, failed={"stream_lost": 2}), outcome()],
            "placements": {"before_kill": [3, 3, 3], "after_kill": [4, 0, 4], "after_restart": [1, 5, 1]},
            "p99_recovery": quick, "restart": {"t_s": 60.0, "ready_t_s": 62.0},
            "audio_check": audio_check([record], t0, 1, 30.0, 62.0, atol=1e-5, min_snr_db=None)}
    assert all(verdict(good).values()) and len(verdict(good)) == 8
    bad = {
        "survivors_failed_0": {"by_sidecar": [outcome(decoded=9, failed={"deadline_exceeded": 1}),
                                              *good["by_sidecar"][1:]]},
        "survivors_lost_0": {"by_sidecar": [outcome(decoded=9, lost=1), *good["by_sidecar"][1:]]},
        "killed_failed_only_stream_lost": {"by_sidecar": [outcome(), outcome(decoded=8, failed={"internal": 2}),
                                                          outcome()]},
        "no_placement_on_killed_while_down": {"placements": {**good["placements"], "after_kill": [4, 1, 4]}},
        "placed_on_restarted": {"placements": {**good["placements"], "after_restart": [3, 0, 4]}},
        "p99_recovered_within_10_s": {"p99_recovery": late},
        "audio_within_tolerance": {"audio_check": audio_check([{**record, "max_abs_diff": 2e-5}], t0, 1, 30.0, 62.0,
                                                              atol=1e-5, min_snr_db=None)},
        "survivors_streams_complete": {"audio_check": audio_check([{**record, "chunks_compared": 4}], t0, 1, 30.0,
                                                                  62.0, atol=1e-5, min_snr_db=None)},
    }
    moved = {"streams_lost": 0, "moves_after_kill": 2}
    good_moved = {**good, "by_sidecar": [outcome(), outcome(), outcome()], "failover": moved}
    assert all(verdict(good_moved).values()) and len(verdict(good_moved)) == 9
    assert not verdict({**good_moved, "failover": {**moved, "streams_lost": 1}})["failover_no_stream_lost"]
    assert not verdict({**good_moved, "by_sidecar": good["by_sidecar"]})["failover_no_stream_lost"]  # moved: no
    # stream_lost on the killed sidecar either
    for mark, change in bad.items():
        marks = verdict({**good, **change})
        assert [name for name, passed in marks.items() if not passed] == [mark], (mark, marks)
    # bfloat16: judged by the ratio, not the difference
    snr = audio_check([{**record, "max_abs_diff": 0.03, "min_snr_db": 27.0}], t0, 1, 30.0, 62.0, None, 20.0)
    assert snr["within_tolerance"] and not audio_check([{**record, "min_snr_db": 3.0}], t0, 1, 30.0, 62.0, None,
                                                       20.0)["within_tolerance"]


def test_a_failed_audio_check_names_the_streams_furthest_from_the_reference_and_their_moves():
    """The report lists the worst streams (lowest chunk SNR first) with their worst chunk's time and the moves their
    pools made of them, so a failed check says which stream, when, and after which move."""
    from code2wav.loadgen.soak_pool_report import worst_streams

    t0 = 1000.0

    def result(stream_id: str, snr: float, worst_t: float | None, compared: int = 5) -> dict:
        return {"stream_id": stream_id, "sidecar": 0, "t_open": t0 + 1, "chunks_compared": compared,
                "min_snr_db": snr, "max_abs_diff": 0.5, "worst_chunk": 3, "worst_chunk_t_sent": worst_t}

    results = [result("calm", 31.0, t0 + 5), result("moved", 8.8, t0 + 52.5), result("drained", 12.0, t0 + 126),
               result("cut", float("-inf"), None, compared=0)]  # nothing compared: not listed
    move = {"reason": "failover", "stream_id": "moved", "at_s": t0 + 52.0, "replay_frames": 580, "recovery_s": 2.5}
    drained = {**move, "stream_id": "drained", "reason": "drain", "at_s": t0 + 125.5}
    per_client = {"c0": {"failover": {"recent": [move]}}, "c1": {"failover": {"recent": [drained]}},
                  "c2": {"failover": None}}
    worst = worst_streams(results, per_client, t0, count=2)
    assert [w["stream_id"] for w in worst] == ["moved", "drained"]
    assert worst[0]["worst_chunk_t_s"] == 52.5 and worst[0]["moves"] == [
        {"reason": "failover", "done_t_s": 52.0, "replay_frames": 580, "recovery_s": 2.5}]
    assert worst[1]["moves"][0]["reason"] == "drain"
    assert [w["stream_id"] for w in worst_streams(results, per_client, t0)] == ["moved", "drained", "calm"]
