"""The soak with faults, short CPU version (issue 22, item 6): loadgen/soak.py on the tiny model with 2 client
processes, one SIGKILLed and restarted, and the sidecar SIGTERMed and restarted once. No chunk is lost by a
client process that lived to the end (each got audio of the right length or a typed error), and the counts
add up. The GPU run (10 minutes, bf16, 80 % of capacity) is in the module docstring of loadgen/soak.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from code2wav.loadgen.soak_summary import summary_lines
from conftest import ROOT, TINY


@pytest.mark.slow
def test_soak_with_client_kill_and_sidecar_restart(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "code2wav.loadgen.soak", "--model", str(TINY), "--device", "cpu",
           "--dtype", "float32", "--duration-s", "40", "--clients", "2", "--streams-per-client", "2",
           "--frame-rate-hz", "50", "--chunk-frames", "10", "--stream-frames", "60", "--kill-every-s", "25",
           "--restart-sidecar-at-s", "6", "--timeout-s", "5", "--spawn-probe-every-s", "20",
           "--sidecar-arg=--stream-ttl-s",
           "--sidecar-arg=3", "--sidecar-arg=--max-streams", "--sidecar-arg=64", "--workdir",
           str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    print("\n" + json.dumps({k: v for k, v in report.items() if k not in ("memory", "workdir")}))
    assert len(report["kills"]) == 1 and report["sidecar_restart"]["exit_code"] == 0
    probe_s = [p["t_s"] for p in report["spawn_probes"]]  # process starts with no kill: at 10 s and 30 s
    assert len(probe_s) == 2 and 10 <= probe_s[0] < 15 and 30 <= probe_s[1] < 35, probe_s
    assert report["sidecar_restart"]["time_to_ready_s"] > 0
    survivors = report["survivors"]
    assert survivors["processes"] == 2 and report["all_survivors_exited"]
    assert survivors["sent"] > 0 and survivors["decoded"] > 0
    assert report["lost"] == 0 and report["bad_audio"] == 0
    assert survivors["sent"] == survivors["decoded"] + survivors["failed"]  # every chunk has exactly one outcome
    assert report["decoded"] + sum(report["failed"].values()) <= report["sent"]  # (killed clients: in flight)
    assert set(report["failed"]) <= {"unavailable", "stream_lost", "deadline_exceeded", "not_found"}, report
    # a failed open across the restart is retried under a new id, never its old one (already_exists forever)
    assert set(report["failed_unsent"]) <= {"unavailable", "stream_lost", "deadline_exceeded", "out_of_order"}, report
    # out_of_order before sending: the client refuses a stream's next chunk while an earlier one is in doubt (sent,
    # then the server went down before replying, and the restart not seen yet); the soak then drops that stream,
    # so there are at most as many as chunks that failed without a reply
    in_doubt = report["failed"].get("unavailable", 0) + report["failed"].get("deadline_exceeded", 0)
    assert report["failed_unsent"].get("out_of_order", 0) <= in_doubt, report
    assert report["crashed_clients"] == []  # every client process lived until the driver killed or stopped it
    rss = [m["sidecar_rss_bytes"] for m in report["memory"] if m["sidecar_rss_bytes"]]
    assert rss and report["p99_by_window"]
    # the diagnosis fields: chunks of a client process's first 15 s apart from the rest (the kill at 25 s starts a
    # new process), and the sidecar's own means per window from /metrics
    new = sum(w["chunks"] for w in report["p99_by_window_new"])
    settled = sum(w["chunks"] for w in report["p99_by_window_settled"])
    assert new > 0 and settled > 0  # the run is longer than a client's first 15 s, and a new client starts
    served = [w for w in report["server_by_window"] if w["chunk_latency_ms_mean"] is not None]
    assert served and all(w["chunk_latency_ms_mean"] > 0 and w["engine_step_ms_mean"] > 0 for w in served)
    assert done.returncode == 0, done.stderr[-3000:]
    # the summary the GPU phases print says what the report says
    lines = summary_lines(report, min_chunks=1, every_s=5)
    counts = json.loads(lines[0].removeprefix("counts: "))
    assert (counts["sent"], counts["decoded"], counts["lost"], counts["failed"]) == (
        report["sent"], report["decoded"], 0, report["failed"])
    assert lines[1] == f"p99 per 10 s window (ms): {[round(w['p99_ms']) for w in report['p99_by_window']]}"
    assert f"max {max(w['p99_ms'] for w in report['p99_by_window']):.0f} ms" in lines[2]
    assert lines[-1].startswith("memory: t=0s RSS ") and lines[-1].count("; ") >= len(report["memory"]) // 6 - 1


def test_a_client_that_dies_before_connecting_stops_the_soak_with_its_exit_code(tmp_path):
    """The soak's clock starts only once every client process has connected; one that exits first (here a real
    process exiting 3, standing in for a client whose imports failed) ends the soak at once, named."""
    from code2wav.loadgen.soak import _wait_connected
    from code2wav.loadgen.spawn import SpawnedSidecar

    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    sidecar = SpawnedSidecar(subprocess.Popen(sleeper), "ipc://unused", "http://unused", tmp_path / "log", "")
    alive = subprocess.Popen(sleeper)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    (tmp_path / "c0.jsonl").write_text('{"kind": "ready"}\n')  # the live one has connected
    with pytest.raises(SystemExit, match=r"c1.jsonl \(exit code 3\)"):
        _wait_connected([(alive, tmp_path / "c0.jsonl"), (dead, tmp_path / "c1.jsonl")], [sidecar], timeout_s=20)
    # the other clients are killed and the sidecar stopped (the sleeping processes stand in for both)
    assert alive.wait(timeout=5) is not None and sidecar.proc.wait(timeout=20) is not None
