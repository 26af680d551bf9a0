"""Faults across a pool, short CPU version (issue 47, item 6): loadgen/soak.py with three sidecars of the tiny
model, three client processes each a ``SidecarPool`` over them, sidecar 1 SIGKILLed at 12 s and started again at
32 s. What it must show: the survivors decode every chunk sent to them (0 lost, 0 failed), the killed sidecar's
chunks in flight end with ``stream_lost`` (counted apart), new streams go to the survivors while it is down and to
it again once it is back, the survivors' p99 is back under its bound within 10 s of the kill, and every recorded
stream's audio equals the same codes decoded again alone, within the exact mode's 1e-5 (float32; batch company
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
def test_a_sidecar_killed_under_a_pool_soak_costs_the_others_nothing(tmp_path):
    out, work = tmp_path / "soak.json", tmp_path / "work"
    cmd = [sys.executable, "-m", "code2wav.loadgen.soak", "--model", str(TINY), "--device", "cpu",
           "--dtype", "float32", "--duration-s", "46", "--clients", "3", "--streams-per-client", "2",
           "--frame-rate-hz", "50", "--chunk-frames", "10", "--stream-frames", "150", "--kill-every-s", "0",
           "--timeout-s", "5", "--sidecars", "3", "--kill-sidecar-at-s", str(KILL_T_S), "--restart-killed-at-s",
           str(RESTART_T_S), "--check-slots", "2", "--sidecar-arg=--max-streams", "--sidecar-arg=64",
           "--workdir", str(work), "--out", str(out)]
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
    assert report["lost"] == 0 and report["crashed_clients"] == [] and report["all_survivors_exited"]
    placed = pool["placements"]
    assert all(count > 0 for count in placed["before_kill"]), placed  # all three took streams
    assert placed["after_kill"][1] == 0 and placed["after_kill"][0] > 0 and placed["after_kill"][2] > 0, placed
    assert placed["after_restart"][1] > 0, placed  # the restarted one takes new streams again
    recovery = pool["p99_recovery"]
    assert recovery["baseline_p99_ms"] > 0 and [w["start_s"] for w in recovery["windows"]] == [0.0, 10.0], recovery
    assert recovery["recovered_after_s"] <= RECOVERY_LIMIT_S, recovery
    check = pool["audio_check"]
    assert check["atol"] == 1e-5 and check["min_snr_db"] is None  # float32 on CPU: judged by the largest difference
    assert check["within_tolerance"] and check["incomplete_on_survivors"] == []
    assert check["survivors_open_across_kill"]["streams"] >= 1 and check["killed_up_to_kill"]["streams"] >= 1
    assert check["restarted"]["streams"] >= 1
    assert check["survivors"]["chunks_compared"] > 200 and check["survivors"]["max_abs_diff"] <= 1e-5
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
    assert pool["verdict"] == {mark: True for mark in pool["verdict"]} and len(pool["verdict"]) == 8
    assert done.returncode == 0, done.stderr[-3000:]
    lines = summary_lines(report, min_chunks=10)
    assert lines[-1].startswith("PASS ") and any(line.startswith("new streams by sidecar: ") for line in lines)
