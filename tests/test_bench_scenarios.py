"""The bench's named scenarios (``loadgen/scenarios.py``) and the A/B driver (``loadgen/ab.py``), on the CPU.

- Every scenario's every run parses with the bench's own parser; flags given beside ``--scenario`` override the
  scenario's; several runs in one invocation write one report each (``-LABEL`` before the suffix).
- A scenario reproduces the run whose figures the docs quote: its flags (with the overrides the docs name) equal
  the settings recorded in that result file under ``docs/results/``.
- ``bench --help`` lists every scenario and its flags; a real ``bench --scenario`` run on the tiny model records
  the scenario's settings and the run's name; an unknown name is a usage error before any work.
- The A/B driver's table: each row's values per round and the ratio of the medians; a real run of it on the CPU,
  both trees this checkout.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from code2wav.loadgen import ab
from code2wav.loadgen.bench import build_parser
from code2wav.loadgen.scenarios import SCENARIOS, expand, labelled_outputs, split_scenario
from conftest import ROOT, TINY, VOXCPM2_TINY

RESULTS = ROOT / "docs" / "results"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
BENCH = [sys.executable, "-m", "code2wav.sidecar", "bench"]


def _dest(flag: str) -> str:
    return build_parser()._option_string_actions[flag].dest


def _set_by(argv: tuple[str, ...]) -> set[str]:
    """The settings keys the flags in ``argv`` set."""
    return {_dest(tok.split("=", 1)[0]) for tok in argv if tok.startswith("--")}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_run_of_every_scenario_parses_with_the_bench_parser(name):
    runs = expand(name, [])
    assert [r.label for r in runs] == [name + (f"-{run}" if run else "") for run, _ in SCENARIOS[name].runs]
    for run in runs:
        args = build_parser().parse_args(list(run.argv))
        assert args.model in ("default", "voxcpm2-default") and args.device == "cuda"
        assert {"model", "device", "dtype"} <= _set_by(run.argv)


def test_explicit_flags_override_the_scenarios():
    (run,) = expand("inprocess", ["--device", "cpu", "--baseline-iters=3", "--model", str(TINY), "--serve-arg=-v"])
    args = build_parser().parse_args(list(run.argv))
    assert (args.device, args.baseline_iters, args.model) == ("cpu", 3, str(TINY))  # overridden
    assert (args.dtype, args.baseline_batch, args.baseline_frames, args.baseline) == ("bfloat16", "1,16,64", "1,25",
                                                                                      "none")  # the scenario's
    assert args.no_sidecar and args.serve_arg == ["-v"]


def test_several_runs_write_one_report_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the output folders exist (bench checks them when it parses its flags)
    (tmp_path / "out").mkdir()
    runs = expand("one-stream,inprocess", ["--json", "out/b.json", "--plot=o.png", "--sidecar-log", "s.log"])
    assert [r.label for r in runs] == ["one-stream-inline", "one-stream-ipc", "inprocess"]
    parsed = [build_parser().parse_args(list(r.argv)) for r in runs]
    assert [(a.json_path, a.plot_path, a.sidecar_log) for a in parsed] == [
        (f"out/b-{label}.json", f"o-{label}.png", f"s-{label}.log") for label in
        ("one-stream-inline", "one-stream-ipc", "inprocess")]
    assert [a.inputs_on for a in parsed] == ["host", "device", "host"]
    (single,) = expand("sidecar", ["--json", "b.json"])
    assert build_parser().parse_args(list(single.argv)).json_path == "b.json"  # one run: the path as given
    assert labelled_outputs(["--json=a/b.c.json", "--frames", "3"], "x") == ["--json=a/b.c-x.json", "--frames", "3"]


def test_scenario_names_are_checked():
    assert split_scenario(["--frames", "3", "--scenario", "inprocess", "--scenario=sidecar"]) == (
        "sidecar", ["--frames", "3"])
    for text in ("inprocess,nope", ",", ""):
        with pytest.raises(ValueError, match="known: inprocess, stock"):
            expand(text, [])
    with pytest.raises(ValueError, match="needs a value"):
        split_scenario(["--scenario"])


# The runs whose figures the docs quote, and the scenario (with the docs' overrides) that makes each again.
REPRODUCES = [
    ("inprocess", [], "h200-bfloat16-state-cols-2.json", {"": ()}),
    ("inprocess", ["--model", "voxcpm2-default", "--baseline-frames", "4,25"], "h200-voxcpm2-bfloat16-pending.json",
     {"": ()}),
    ("full", [], "h200-bfloat16-glue.json", {"": ()}),
    ("sidecar", ["--concurrency", "64,256"], "h200-bfloat16-buckets16.json", {"": ()}),
    ("realtime", [], "h200-bfloat16-buckets16-realtime.json", {"": ()}),
    ("one-stream", [], "h200-c1-inputs.json", {"one-stream-inline": ("run8", "default-bfloat16-host"),
                                               "one-stream-ipc": ("run8", "default-bfloat16-device")}),
    ("voxcpm2", [], "h200-voxcpm2-cublas-rows.json", {"voxcpm2-float32": ("float32",),
                                                      "voxcpm2-bfloat16": ("bfloat16",)}),
    ("voxcpm2-one-stream", [], "h200-c1-inputs.json",
     {"voxcpm2-one-stream-inline": ("run8", "voxcpm2-default-float32-host"),
      "voxcpm2-one-stream-ipc": ("run8", "voxcpm2-default-float32-device")}),
    ("voxcpm2-realtime", [], "h200-voxcpm2-fused-realtime.json", {"": ()}),
]


@pytest.mark.parametrize("name, overrides, source, keys", REPRODUCES, ids=[f"{r[0]}:{r[2]}" for r in REPRODUCES])
def test_the_scenario_makes_the_run_the_docs_quote(name, overrides, source, keys):
    report = json.loads((RESULTS / source).read_text())
    runs = expand(name, overrides)
    assert len(runs) == len(keys)
    for run in runs:
        node = report
        for key in keys.get(run.label, keys.get("", ())):
            node = node[key]
        settings = node["settings"]
        args = vars(build_parser().parse_args(list(run.argv)))
        compared = sorted(_set_by(run.argv) & set(settings))
        assert len(compared) >= 5, (run.label, compared)
        assert {k: settings[k] for k in compared} == {k: args[k] for k in compared}, run.label
        assert settings["dtype"] == node["environment"]["dtype"] and node["environment"]["gpu"] == "NVIDIA H200"


def test_the_scenario_check_sees_a_changed_flag():
    report = json.loads((RESULTS / "h200-bfloat16-state-cols-2.json").read_text())["settings"]
    (run,) = expand("inprocess", ["--baseline-iters", "31"])
    args = vars(build_parser().parse_args(list(run.argv)))
    assert args["baseline_iters"] != report["baseline_iters"]


def test_help_lists_every_scenario_with_its_flags():
    proc = subprocess.run([*BENCH, "--help"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--scenario NAME[,NAME]" in proc.stdout
    for name, scenario in SCENARIOS.items():
        assert f"  {name}: " in proc.stdout
        for _, flags in scenario.runs:
            assert " ".join(flags) in proc.stdout


def test_a_scenario_run_records_its_settings_and_name(tmp_path):
    """``--scenario voxcpm2`` on the CPU (tiny VoxCPM2 model, few iterations): two runs, one report each, each with
    the scenario's flags, the overrides and the run's name; the in-process rows it asks for, no sidecar."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([*BENCH, "--scenario", "voxcpm2", "--model", str(VOXCPM2_TINY), "--device", "cpu",
                           "--baseline-iters", "2", "--baseline-batch", "1,2", "--json", str(out)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[bench] scenario voxcpm2-float32: code2wav-sidecar bench --model voxcpm2-default" in proc.stderr
    for dtype in ("float32", "bfloat16"):
        report = json.loads((tmp_path / f"bench-voxcpm2-{dtype}.json").read_text())
        s = report["settings"]
        assert (s["scenario"], s["dtype"], s["model"], s["device"]) == (f"voxcpm2-{dtype}", dtype, str(VOXCPM2_TINY),
                                                                       "cpu")
        assert (s["baseline_frames"], s["chunk_frames"], s["baseline_iters"], s["no_sidecar"]) == ("4,25", 4, 2, True)
        names = {b["name"] for b in report["baselines"]}
        assert {"exact-eager-b1", "exact-eager-b2", "exact-eager-b1-t25", "exact-eager-b2-t25"} <= names, names
        assert report["results"] == []
    assert not out.exists()


def test_an_unknown_scenario_is_a_usage_error(tmp_path):
    proc = subprocess.run([*BENCH, "--scenario", "inprocess,fastest", "--json", str(tmp_path / "b.json")],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "error: --scenario 'inprocess,fastest': unknown ['fastest']; known: inprocess" in proc.stderr
    assert "[bench]" not in proc.stderr and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------ A/B
def _report(rows: dict[str, tuple[float, float]], levels: dict[int, tuple[float, float, float]]) -> dict:
    return {"baselines": [{"name": n, "latency_ms_p50": p50, "audio_s_per_s": thru} for n, (p50, thru) in rows.items()],
            "results": [{"concurrency": c, "arrival": "closed", "chunk_latency_ms_p50": a, "chunk_latency_ms_p99": b,
                         "audio_s_per_s": t} for c, (a, b, t) in levels.items()]}


def test_the_ab_table_takes_the_ratio_of_the_medians():
    base = [_report({"exact-graph-b64": (30.0, 4000.0), "only-base": (1.0, 1.0)}, {64: (40.0, 50.0, 2800.0)}),
            _report({"exact-graph-b64": (32.0, 3750.0), "only-base": (1.0, 1.0)}, {64: (42.0, 52.0, 2700.0)}),
            _report({"exact-graph-b64": (31.0, 3870.0), "only-base": (1.0, 1.0)}, {64: (41.0, 51.0, 2750.0)})]
    new = [_report({"exact-graph-b64": (27.0, 4440.0)}, {64: (38.0, 49.0, 2900.0)}),
           _report({"exact-graph-b64": (29.0, 4140.0)}, {64: (39.0, 47.0, 2950.0)}),
           _report({"exact-graph-b64": (28.0, 4280.0)}, {64: (37.0, 48.0, 2850.0)})]
    rows = {(r["row"], r["metric"]): r for r in ab.compare(base, new)}
    assert set(rows) == {("exact-graph-b64", "latency_ms_p50"), ("exact-graph-b64", "audio_s_per_s"),
                         ("64 streams (closed)", "chunk_latency_ms_p50"), ("64 streams (closed)", "chunk_latency_ms_p99"),
                         ("64 streams (closed)", "audio_s_per_s")}  # a row one tree lacks is not compared
    p50 = rows[("exact-graph-b64", "latency_ms_p50")]
    assert p50["base"] == [30.0, 32.0, 31.0] and p50["new"] == [27.0, 29.0, 28.0]
    assert p50["ratio"] == round(28.0 / 31.0, 4) == 0.9032
    assert rows[("64 streams (closed)", "audio_s_per_s")]["ratio"] == round(2900.0 / 2750.0, 4)
    text = ab.format_rows("inprocess", ab.compare(base, new))
    assert "exact-graph-b64" in text and "0.903" in text and "30 32 31" in text


def test_the_ab_table_compares_the_stage_tables_kind_by_kind():
    def stages(round_trip_us: float, launch_us: float, kinds=("host", "device")) -> dict:
        return {"stages": [{"inputs_on": kind, "round_trip": {"p50_us": round_trip_us},
                            "stages": [{"stage": "launch", "p50_us": launch_us}]} for kind in kinds],
                "handoff": [{"armed": True, "p50_us": 1300.0}]}

    base = [stages(2300.0, 250.0), stages(2310.0, 240.0)]
    new = [stages(2000.0, 200.0, ("host", "device", "device-events")),
           stages(2020.0, 210.0, ("host", "device", "device-events"))]
    rows = {(r["row"], r["metric"]): r for r in ab.compare(base, new)}
    assert set(rows) == {("c1 host: round trip", "p50_us"), ("c1 host: launch", "p50_us"),
                         ("c1 device: round trip", "p50_us"), ("c1 device: launch", "p50_us"),
                         ("hand-off on the GPU, armed", "p50_us")}  # device-events: the base has none
    assert rows[("c1 host: round trip", "p50_us")]["ratio"] == round(2010.0 / 2305.0, 4)


def test_ab_runs_both_trees_alternating_and_tabulates_them(tmp_path):
    """The driver for real on the CPU: this checkout as both trees, one round of ``inprocess`` on the tiny model;
    every report written, and the table's values are those reports'."""
    proc = subprocess.run([sys.executable, "-m", "code2wav.loadgen.ab", "--scenario", "inprocess", "--rounds", "1",
                           "--base-path", str(ROOT), "--new-path", str(ROOT), "--out", str(tmp_path), "--",
                           "--model", str(TINY), "--device", "cpu", "--dtype", "float32", "--baseline-iters", "2",
                           "--baseline-batch", "1", "--baseline-frames", "1,5"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.index("round 1, inprocess, base") < proc.stderr.index("round 1, inprocess, new")
    reports = {tree: json.loads((tmp_path / f"ab-inprocess-{tree}-1.json").read_text()) for tree in ab.TREES}
    table = json.loads((tmp_path / "ab.json").read_text())["inprocess"]
    by_key = {(r["row"], r["metric"]): r for r in table}
    for tree, report in reports.items():
        assert report["settings"]["baseline_frames"] == "1,5" and report["settings"]["baseline"] == "none"
        for row in report["baselines"]:
            assert by_key[(row["name"], "latency_ms_p50")][tree] == [row["latency_ms_p50"]]
    b1 = by_key[("exact-eager-b1-t5", "latency_ms_p50")]
    assert b1["ratio"] == round(statistics.median(b1["new"]) / statistics.median(b1["base"]), 4)
    assert "inprocess: new / base" in proc.stdout


# ------------------------------------------------------------------------------------------------ capacity
def test_capacity_is_the_largest_level_that_held():
    from code2wav.loadgen.capacity import capacity

    soak4 = json.loads((RESULTS / "h200-soak4-capacity.json").read_text())  # p99 191.2 / 230.95 / 988.13 / 2050.07 ms
    assert capacity(soak4) == 896 and capacity(soak4, p99_ms=200) == 768 and capacity(soak4, p99_ms=100) is None
    realtime = json.loads((RESULTS / "h200-bfloat16-buckets16-realtime.json").read_text())
    assert capacity(realtime) == 2816
    realtime["results"][1]["errors"] = 1  # a level with an error did not hold, whatever its latency
    assert capacity(realtime) == 2304
    realtime["results"][0]["refused_streams"] = 3
    assert capacity(realtime) is None


# ------------------------------------------------------------------------------------------------ GPU phases
PHASES = ROOT / ".ci" / "gpu-phases"
STANDING = {"ab", "bench", "capacity", "fidelity", "pool-capacity", "roofline", "soak-collect", "soak-pool",
            "soak-short", "soak-start", "voxcpm2"}


def test_gpu_phases_are_standing_tools_with_real_flags():
    """Each phase is a few lines that call standing tools: its shell parses, every ``python3 -m code2wav...`` module
    exists, every flag it gives a ``code2wav-sidecar`` command is in that command's ``--help``, and the scenarios it
    names by default exist."""
    import importlib.util
    import re

    phases = {p.name for p in PHASES.iterdir() if os.access(p, os.X_OK)}
    assert phases == STANDING
    helps: dict[str, str] = {}
    for path in sorted(PHASES.iterdir()):
        text = path.read_text()
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, path.name
        assert "loadgen/probes" not in text and len(text.splitlines()) <= 30, path.name
        for module in re.findall(r"python3 -m (code2wav[\w.]*)", text):
            assert importlib.util.find_spec(module) is not None, (path.name, module)
        joined = text.replace("\\\n", " ")
        for command, rest in re.findall(r"python3 -m code2wav\.sidecar (bench|fidelity|profile)\b([^\n|;]*)", joined):
            if command not in helps:
                helps[command] = subprocess.run([*BENCH[:-1], command, "--help"], capture_output=True, text=True,
                                                env=ENV, cwd=ROOT, timeout=120).stdout
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                assert flag in helps[command], (path.name, command, flag)
        for names in re.findall(r'--scenario "\$\{\w+:-([\w,-]+)\}"', joined) + \
                re.findall(r"--scenario (\w[\w,-]*)", joined):
            expand(names, [])  # raises on an unknown name
