"""The real-time capacity an open-loop bench report shows: the most streams a level held with its p99 chunk
latency at most ``--p99-ms`` (250) and no errors or refused streams. The soak phases size their load from it.

    python -m code2wav.loadgen.capacity report.json [--p99-ms 250]

Prints each level on stderr and the capacity on stdout; a report where no level held prints half its lowest level
(for the soaks: a load below anything measured) and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys


def capacity(report: dict, p99_ms: float = 250.0) -> int | None:
    """The largest ``concurrency`` of ``report``'s levels that held; None when none did."""
    held = [r["concurrency"] for r in report["results"]
            if r["errors"] == 0 and not r.get("refused_streams") and r["chunk_latency_ms_p99"] <= p99_ms]
    return max(held) if held else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m code2wav.loadgen.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a bench report (JSON) of --arrival realtime levels")
    p.add_argument("--p99-ms", type=float, default=250.0, help="the p99 chunk latency a level must hold")
    args = p.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    for r in report["results"]:
        print(f"capacity level {r['concurrency']}: p99 {r['chunk_latency_ms_p99']:.1f} ms, errors {r['errors']}, "
              f"refused {r.get('refused_streams')}", file=sys.stderr)
    found = capacity(report, args.p99_ms)
    if found is None:
        print(min(r["concurrency"] for r in report["results"]) // 2)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
