"""A change against the code before it, measured in one run: bench scenarios on two trees, alternating.

Machines differ from one start to the next by more than many changes move a figure, so a before/after is only
worth quoting from one run on one machine. This runs each run of the named scenarios (scenarios.py) once per tree
per round, base first, with each tree's code on ``PYTHONPATH`` (``--base-path``, ``--new-path``), writes every
report under ``--out`` (``ab-LABEL-base-ROUND.json``, ``ab-LABEL-new-ROUND.json``), then prints one table per run:
each in-process row (p50, audio-s/s), each sidecar level (p50, p99, audio-s/s) and each stage of ``--stages`` (p50),
every round of both trees, and the ratio new / base of their medians. ``ab.json`` holds the table. The scenarios' flags come from this tree, so
the base tree needs no ``--scenario`` of its own, only the flags. Arguments after ``--`` go to every run (they
override the scenarios'). ``.ci/gpu-phases/ab`` runs it on the GPU machine.

    python -m code2wav.loadgen.ab --scenario inprocess --rounds 2 --base-path BASE --new-path NEW --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .scenarios import Run, expand

TREES = ("base", "new")
BASELINE_METRICS = ("latency_ms_p50", "audio_s_per_s")  # an in-process row's
LEVEL_METRICS = ("chunk_latency_ms_p50", "chunk_latency_ms_p99", "audio_s_per_s")  # a sidecar level's


def measured(report: dict) -> dict[tuple[str, str], float]:
    """``(row, metric) -> value`` of one bench report: in-process rows by name, sidecar levels by stream count."""
    found = {}
    for row in report.get("baselines", []):
        for metric in BASELINE_METRICS:
            if row.get(metric) is not None:
                found[(row["name"], metric)] = float(row[metric])
    for row in report.get("results", []):
        for metric in LEVEL_METRICS:
            if row.get(metric) is not None:
                found[(f"{row['concurrency']} streams ({row['arrival']})", metric)] = float(row[metric])
    for table in report.get("stages", []):  # bench --stages: one chunk at concurrency 1, per kind of inputs
        kind = table["inputs_on"]
        found[(f"c1 {kind}: round trip", "p50_us")] = float(table["round_trip"]["p50_us"])
        for stage in table["stages"]:
            found[(f"c1 {kind}: {stage['stage']}", "p50_us")] = float(stage["p50_us"])
    for row in report.get("handoff", []):  # and the hand-off on the GPU's clock
        found[(f"hand-off on the GPU, {'armed' if row['armed'] else 'events'}", "p50_us")] = float(row["p50_us"])
    return found


def compare(base: list[dict], new: list[dict]) -> list[dict]:
    """One entry per ``(row, metric)`` that both trees measured in every round: the values of each round and
    ``ratio`` = median(new) / median(base) (None where the base's median is 0)."""
    base_m, new_m = [measured(r) for r in base], [measured(r) for r in new]
    keys = [k for k in (base_m[0] if base_m else {}) if all(k in m for m in base_m + new_m)]
    rows = []
    for row, metric in keys:
        b = [m[(row, metric)] for m in base_m]
        n = [m[(row, metric)] for m in new_m]
        mid = statistics.median(b)
        rows.append({"row": row, "metric": metric, "base": b, "new": n,
                     "ratio": round(statistics.median(n) / mid, 4) if mid else None})
    return rows


def format_rows(label: str, rows: list[dict]) -> str:
    lines = [f"{label}: new / base (medians over rounds; < 1 is faster for ms, slower for audio-s/s)",
             f"  {'row':<34} {'metric':<22} {'base':>22} {'new':>22} {'new/base':>8}"]
    for r in rows:
        base = " ".join(f"{v:g}" for v in r["base"])
        new = " ".join(f"{v:g}" for v in r["new"])
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"  {r['row'][:34]:<34} {r['metric']:<22} {base:>22} {new:>22} {ratio:>8}")
    return "\n".join(lines)


def bench_command(run: Run, json_path: Path) -> list[str]:
    return [sys.executable, "-m", "code2wav.sidecar", "bench", *run.argv, "--json", str(json_path)]


def run_trees(runs: list[Run], rounds: int, paths: dict[str, str], out: Path) -> tuple[dict, int]:
    """Every run on both trees, ``rounds`` times, base first; ``(label -> tree -> [report], worst exit status)``."""
    reports = {run.label: {tree: [] for tree in TREES} for run in runs}
    status = 0
    for round_ in range(1, rounds + 1):
        for run in runs:
            for tree in TREES:
                path = out / f"ab-{run.label}-{tree}-{round_}.json"
                print(f"[ab] round {round_}, {run.label}, {tree}", file=sys.stderr, flush=True)
                env = {**os.environ, "PYTHONPATH": paths[tree]}
                rc = subprocess.run(bench_command(run, path), env=env).returncode
                status = max(status, rc)
                if path.is_file():
                    reports[run.label][tree].append(json.loads(path.read_text()))
    return reports, status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m code2wav.loadgen.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", required=True, help="scenario names, comma-separated (bench --help lists them)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of base then new (default 2)")
    p.add_argument("--base-path", required=True, help="PYTHONPATH of the base tree's runs")
    p.add_argument("--new-path", required=True, help="PYTHONPATH of the working tree's runs")
    p.add_argument("--out", required=True, help="folder for the reports and ab.json")
    args = p.parse_args(own)
    try:
        runs = expand(args.scenario, extra)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports, status = run_trees(runs, max(1, args.rounds), {"base": args.base_path, "new": args.new_path}, out)
    table = {}
    for label, by_tree in reports.items():
        if len(by_tree["base"]) != len(by_tree["new"]) or not by_tree["base"]:
            print(f"{label}: not compared (a run failed: {len(by_tree['base'])} base, {len(by_tree['new'])} new "
                  "reports)")
            status = max(status, 1)
            continue
        table[label] = compare(by_tree["base"], by_tree["new"])
        print(format_rows(label, table[label]))
    (out / "ab.json").write_text(json.dumps(table, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
