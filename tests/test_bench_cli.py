"""``code2wav-sidecar bench`` respects the person running it: progress per phase on stderr, Ctrl-C keeps the
partial JSON, ``--plot`` fails at the start when matplotlib is missing, figures rounded to what they mean, the
real-time lines on the plot, and streams the server refuses (busy) recorded as refused at that load while the
run goes on. Each CLI case runs the real command in a subprocess against a real spawned sidecar (tiny model, CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from code2wav.loadgen.drive import FRAME_S
from code2wav.loadgen.phases import Progress, Step
from code2wav.loadgen.report import draw, load, print_table, upstream_twin
from code2wav.loadgen.timing import baseline_row, slow_calls
from conftest import ROOT, TINY

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
BENCH = [sys.executable, "-m", "code2wav.sidecar", "bench", "--model", str(TINY), "--device", "cpu"]


def _decimals(value: float) -> int:
    text = repr(float(value))
    return 0 if text.endswith(".0") else len(text.split(".")[1])


def test_plot_without_matplotlib_fails_before_any_work(tmp_path):
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named matplotlib (test shim)')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), str(ROOT)])}
    report = tmp_path / "bench.json"
    proc = subprocess.run([*BENCH, "--plot", str(tmp_path / "b.png"), "--json", str(report)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--plot needs matplotlib: pip install matplotlib" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "ready:" not in proc.stdout and "[bench] phase" not in proc.stderr  # nothing was spawned or measured
    assert not report.exists()


def test_busy_streams_are_recorded_as_refused_and_the_run_goes_on(tmp_path):
    """A sidecar with 2 stream slots: at 4 streams, 2 are refused (busy) and the other 2 are measured. Closed loop,
    each level runs at least --min-streams streams (4), in turn per accepted slot: 2 slots run 2 each (also at 4
    streams, where 2 were refused), 1 slot runs 4."""
    report_path = tmp_path / "bench.json"
    proc = subprocess.run([*BENCH, "--no-baselines", "--concurrency", "2,4,1", "--frames", "26", "--min-streams", "4",
                           "--serve-arg=--max-streams", "--serve-arg=2", "--json", str(report_path)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    rows = {r["concurrency"]: r for r in json.loads(report_path.read_text())["results"]}
    assert [(c, rows[c]["streams"], rows[c]["refused_streams"], rows[c]["errors"]) for c in (2, 4, 1)] == [
        (2, 4, 0, 0), (4, 4, 2, 0), (1, 4, 0, 0)]
    assert rows[4]["chunks"] == 4 * 2  # the accepted streams ran to the end: 1 + 25 frames each
    assert rows[1]["chunks"] == 4 * 2  # one slot, 4 streams in turn
    assert all(s.startswith("Busy: ") for s in rows[4]["refused_samples"])
    # progress: the phase, each step with what it is, and the time left
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("[bench] ")]
    assert progress[0].startswith("[bench] phase 1/1 sidecar: 3 steps (2 closed-loop streams, 4 closed-loop "
                                  "streams, 1 closed-loop streams)")
    assert any("sidecar 2/3: 4 closed-loop streams done in" in ln and "2 refused (busy)" in ln
               and "about" in ln and "left" in ln for ln in progress)
    assert progress[-1].endswith("phase done")
    assert "sidecar log: " in proc.stdout
    # figures rounded to what they mean: latencies to 10 us, throughput to 4 significant digits
    for r in rows.values():
        for key in ("chunk_latency_ms_p50", "chunk_latency_ms_p95", "chunk_latency_ms_p99", "mean_chunk_latency_ms"):
            assert _decimals(r[key]) <= 2, (key, r[key])
        assert len(repr(r["audio_s_per_s"]).replace(".", "").lstrip("0").rstrip("0")) <= 4  # 4 significant digits
        assert r["audio_s_per_s"] > 0 and _decimals(r["wall_s"]) <= 2
        assert 0 < r["loadgen_cpu_s_per_s"] < 64  # the driving process's own CPU per second: it worked, it is a rate


def test_several_driving_processes_share_a_level_and_merge_its_figures(tmp_path):
    """``--drivers 2``: each level's streams split over two processes (3 and 2 of 5), warmed up and started
    together against one sidecar; the row merges them (every stream run, every chunk counted, the server's batch
    figures read around the whole level) and gives the busiest driver's CPU."""
    report_path = tmp_path / "bench.json"
    proc = subprocess.run([*BENCH, "--no-baselines", "--concurrency", "5", "--frames", "26", "--min-streams", "5",
                           "--drivers", "2", "--clients", "1", "--json", str(report_path)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (row,) = json.loads(report_path.read_text())["results"]
    assert (row["streams"], row["chunks"], row["errors"], row["refused_streams"]) == (5, 10, 0, 0)
    assert row["mean_batch_size"] >= 1 and 0 < row["loadgen_cpu_s_per_s"] < 64
    assert row["chunk_latency_ms_p50"] > 0 and row["first_chunk_latency_ms_p50"] > 0


def test_drivers_share_and_merge_as_documented():
    from code2wav.loadgen.drive import LevelResult
    from code2wav.loadgen.drivers import merge, shares

    assert shares(5, 2) == [3, 2] and shares(2, 4) == [1, 1, 0, 0] and sum(shares(4096, 3)) == 4096
    a = LevelResult(5, "exact", "realtime", 4, 0, 2.0, 3.0, [1.0, 2.0], [5.0], loadgen_cpu_s=1.5, streams=3,
                    refused_streams=1, refused_samples=["Busy: a"], started_s=100.0)
    b = LevelResult(2, "exact", "realtime", 2, 1, 2.5, 1.0, [3.0], [6.0], loadgen_cpu_s=0.5, streams=2,
                    error_samples=["Internal: b"], started_s=100.25)
    m = merge(7, [a, b])
    assert (m.concurrency, m.chunks, m.errors, m.wall_s, m.audio_s, m.streams, m.refused_streams) == (
        7, 6, 1, 2.75, 4.0, 5, 1)  # the first clock's start to the last one's end
    assert m.chunk_latency_ms == [1.0, 2.0, 3.0] and m.first_chunk_latency_ms == [5.0, 6.0]
    assert m.loadgen_cpu_s == 1.5 and m.refused_samples == ["Busy: a"] and m.error_samples == ["Internal: b"]


def test_ctrl_c_writes_the_partial_json(tmp_path):
    """Open loop, so each level lasts at least its streams' staggered starts (the tiny model's 51 frames take 0.1 s):
    SIGINT, sent once the second level has started, lands inside it."""
    report_path = tmp_path / "bench.json"
    # SIGINT at its default in the bench: a suite started in the background by a shell (``pytest &``) runs with SIGINT
    # ignored, which its children inherit, and a Python started so never raises KeyboardInterrupt (a small exec
    # wrapper resets it: preexec_fn is not safe in a process with threads)
    reset = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    proc = subprocess.Popen([sys.executable, "-c", reset, *BENCH[1:], "--no-baselines", "--arrival", "realtime",
                             "--concurrency", "1,2", "--frames", "51", "--json", str(report_path)],
                            stdout=open(tmp_path / "stdout.txt", "w"), stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "sidecar 2/2: 2 real-time streams ..." in line:  # the second level has started
                proc.send_signal(signal.SIGINT)
                break
        seen += proc.stderr.readlines()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen)
    assert proc.returncode == 130, stderr
    assert "interrupted during sidecar: 2 real-time streams" in stderr and "Traceback" not in stderr
    report = json.loads(report_path.read_text())
    assert report["interrupted"] == "sidecar: 2 real-time streams"
    assert [(r["concurrency"], r["chunks"], r["errors"]) for r in report["results"]] == [(1, 3, 0)]  # 1+25+25
    assert "wrote " + str(report_path) + " (interrupted: partial)" in (tmp_path / "stdout.txt").read_text()


def test_time_left_counts_known_durations_and_estimates_the_rest():
    steps = [Step("a", weight=1), Step("b", weight=4), Step("c", expected_s=7.5), Step("d", weight=2)]
    assert Progress.time_left_s(steps, 0, []) is None  # nothing measured yet: no rate for weighted steps
    assert Progress.time_left_s(steps, 1, [3.0]) == pytest.approx(4 * 3.0 + 7.5 + 2 * 3.0)
    assert Progress.time_left_s(steps, 3, [3.0, 5.0, 9.0]) == pytest.approx(2 * (8.0 / 5))
    assert Progress.time_left_s(steps[2:3], 0, []) == 7.5
    assert Progress.left_text(Progress(), steps, 4, [1, 1, 1, 1]) == "phase done"
    # a step of weight 0 (loading a model) is no sample for the rate of the others
    assert Progress.time_left_s([Step("load", weight=0), Step("run", weight=3)], 1, [40.0]) is None


def test_plot_draws_the_real_time_lines():
    pytest.importorskip("matplotlib")
    report = load(str(ROOT / "docs" / "results" / "h200-bfloat16.json"))
    fig = draw(report)
    latency_ax, throughput_ax = fig.axes
    chunk_ms = report.settings["chunk_frames"] * FRAME_S * 1e3
    realtime = {ax: [ln for ln in ax.get_lines() if ln.get_label().startswith("real time")]
                for ax in (latency_ax, throughput_ax)}
    (budget,) = realtime[latency_ax]
    assert list(budget.get_ydata()) == [chunk_ms, chunk_ms]  # a chunk's own audio: 2 s for 25 frames
    (per_stream,) = realtime[throughput_ax]
    conc = [r["concurrency"] for r in report.results]
    assert list(per_stream.get_xdata()) == list(per_stream.get_ydata()) == [min(conc), max(conc)]


def test_in_process_rows_are_ratios_to_the_upstream_baselines(capsys):
    """Issue 21: every figure also as a ratio to stock in the same run. The bf16 run of this session: the graph
    step's 25-frame chunk at batch 1 against stock's (3.224 / 6.099 ms), throughput against stock's batch-1 runner."""
    report = load(str(ROOT / "docs" / "results" / "h200-bfloat16-fold.json"))
    by_name = {b["name"]: b for b in report.baselines}
    assert upstream_twin(report, by_name["exact-graph-b1"])["name"] == "vllm-omni-stock-b1"
    assert upstream_twin(report, by_name["exact-graph-b1-t1"])["name"] == "vllm-omni-stock-b1-t1"
    assert upstream_twin(report, by_name["exact-graph-b16"]) is None  # stock ran no batch 16
    print_table(report)
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    graph_b1, graph_b64 = lines["exact-graph-b1"], lines["exact-graph-b64"]
    assert graph_b1[7] == f"{3.224 / 6.099:.2f}" == "0.53"  # x_p50
    assert graph_b64[6] == f"{2374.0 / 327.9:.2f}" and graph_b64[7] == "-"  # x_thru; no stock row at batch 64


def test_no_sidecar_runs_only_the_baselines(tmp_path):
    """``--no-sidecar``: the in-process rows and nothing spawned."""
    report_path = tmp_path / "bench.json"
    proc = subprocess.run([*BENCH, "--no-sidecar", "--baseline-iters", "2", "--json", str(report_path)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    names = {b["name"] for b in report["baselines"]}
    assert {"window-eager-b1", "exact-eager-b1"} <= names and not any("graph" in n for n in names)  # CPU: no graphs
    assert report["results"] == [] and "ready:" not in proc.stdout
    assert all(isinstance(b["slow_calls"], list) for b in report["baselines"])


def test_slow_calls_name_each_call_far_over_the_median_in_call_order():
    """What a p95 hides: which of the timed calls were slow (the first ones: left to warm up; any: the machine)."""
    times_s = [0.010, 0.031, 0.010, 0.011, 0.0149, 0.0151, 0.010]  # median 0.011 s: the limit is 16.5 ms
    assert slow_calls(times_s) == [[1, 31.0]]
    assert slow_calls([0.01] * 30) == []
    row = baseline_row("exact-graph-b64", 64, 25, [0.01] * 28 + [0.03, 0.02], TinyRate())
    assert row["slow_calls"] == [[28, 30.0], [29, 20.0]] and row["latency_ms_p95"] == pytest.approx(20.0)  # the second slowest of 30


class TinyRate:
    samples_per_frame, sample_rate_hz = 1920, 24000


def test_inputs_on_the_device_needs_a_cuda_device_and_sidecar_levels(tmp_path):
    proc = subprocess.run([*BENCH, "--no-baselines", "--device", "cpu", "--inputs-on", "device", "--concurrency", "1"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert "--inputs-on device needs sidecar levels on a CUDA device; got --device cpu" in proc.stderr
    assert "ready:" not in proc.stdout  # refused before a sidecar was spawned
    proc = subprocess.run([*BENCH, "--no-sidecar", "--inputs-on", "device"], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert "--inputs-on device needs sidecar levels on a CUDA device; --no-sidecar runs no sidecar levels" \
        in proc.stderr
    assert "[bench] phase" not in proc.stderr  # refused before any work


@pytest.mark.cuda
@pytest.mark.parametrize("model, frames", [("default", "26"), ("voxcpm2-default", "9")])
def test_inputs_on_the_device_go_by_cuda_ipc_and_audio_is_counted_when_ready(tmp_path, model, frames):
    """Both families, inputs on the GPU: every chunk of every level went by CUDA IPC (the client's own count) and
    none failed."""
    report_path = tmp_path / "bench.json"
    env = {**ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([*BENCH, "--no-baselines", "--model", model, "--device", "cuda", "--inputs-on", "device",
                           "--concurrency", "1,3", "--frames", frames, "--first-chunk-frames", "1", "--chunk-frames",
                           "4", "--min-streams", "3", "--json", str(report_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(report_path.read_text())
    assert report["settings"]["inputs_on"] == "device"
    for row in report["results"]:
        assert row["errors"] == 0 and row["refused_streams"] == 0, row
        assert row["chunks"] > 0 and row["ipc_chunks"] == row["chunks"], row


def test_a_baseline_at_the_history_length_also_times_it_as_a_replay():
    """``--baseline-frames H`` (the model's history frames): besides ``exact-eager-b1-tH`` a ``replay-eager-b1-tH`` row,
    the same frames as one all-context chunk (state only, no audio); other lengths get no replay row."""
    import torch

    from code2wav.loadgen.baselines import run_baselines
    from code2wav.sidecar.models import load_model

    model = load_model(str(TINY), torch.device("cpu"), "float32")
    history = model.contract.history_frames
    rows = {r.name: r for r in run_baselines(model, new_frames=7, iters=1, warmup=0, frames=(history, 3))}
    assert {f"replay-eager-b1-t{history}", f"exact-eager-b1-t{history}", "exact-eager-b1-t3"} <= set(rows)
    assert not any(name.startswith("replay") and name.endswith("-t3") for name in rows)
    assert rows[f"replay-eager-b1-t{history}"].new_frames == history


def test_a_sidecar_phase_that_fails_to_start_stops_the_sidecar_it_spawned(monkeypatch):
    """``with phase:`` does not call ``__exit__`` when ``__enter__`` raises: the phase stops what it started itself
    (here the driving processes fail to warm up after the sidecar was spawned; both are stand-ins, recorded)."""
    import argparse

    import torch

    from code2wav.loadgen import phases

    stopped = []

    class Spawned:
        address, metrics_url = "ipc:///nowhere/sidecar.sock", None

        def banner(self) -> str:
            return "spawned"

        def stop(self, log_copy=None) -> None:
            stopped.append(log_copy)

    def failing_drivers(*args, **kwargs):
        raise RuntimeError("bench driver 0 did not warm up")

    monkeypatch.setattr(phases, "spawn_sidecar", lambda *a, **k: Spawned())
    monkeypatch.setattr(phases, "Drivers", failing_drivers)
    args = argparse.Namespace(concurrency="4", metrics_url=None, inputs_on="host", address=None, model="m",
                              dtype="float32", serve_arg=[], drivers=2, clients=1, server_key=None, mode="exact",
                              frames=26, first_chunk_frames=1, chunk_frames=25, min_streams=4, early_audio=False, arrival="closed",
                              sidecar_log="kept.log")
    phase = phases.SidecarPhase(args, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="did not warm up"):
        with phase:
            pass
    assert stopped == ["kept.log"]
