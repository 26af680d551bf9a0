"""What a soak report (``loadgen/soak.py``'s JSON) says, in a few lines: the outcome counts, p99 per 10 s window
(all chunks, then a client process's first seconds apart from the rest), the sidecar's own arrival -> reply mean
per window, and its memory over time. The GPU phases print it after a soak.

    python -m code2wav.loadgen.soak_summary soak.json [--min-chunks 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

COUNTS = ("duration_s", "clients", "streams_per_client", "sent", "decoded", "failed", "failed_unsent", "bad_audio",
          "lost", "survivors", "sidecar_restart")
GIB = 2 ** 30


def summary_lines(report: dict, min_chunks: int = 100, every_s: float = 60.0) -> list[str]:
    """The summary; windows with fewer than ``min_chunks`` chunks (the first and last seconds) are left out of the
    p99 lists, memory is shown every ``every_s`` seconds."""
    lines = ["counts: " + json.dumps({k: report[k] for k in COUNTS if k in report})]
    windows = [w for w in report["p99_by_window"] if w["chunks"] >= min_chunks]
    lines.append("p99 per 10 s window (ms): " + str([round(w["p99_ms"]) for w in windows]))
    if windows:
        p99 = [w["p99_ms"] for w in windows]
        lines.append(f"p99 windows: median {statistics.median(p99):.0f} ms, max {max(p99):.0f} ms")
    for key in ("p99_by_window_settled", "p99_by_window_new"):
        shown = [(round(w["window_start_s"]), round(w["p99_ms"])) for w in report.get(key, [])
                 if w["chunks"] >= min_chunks // 5]
        lines.append(f"{key} (start s, p99 ms): {shown}")
    lines.append("server arrival -> reply mean per window (start s, ms): " + str(
        [(round(w["window_start_s"]), w["chunk_latency_ms_mean"]) for w in report.get("server_by_window", [])]))
    memory, next_t = [], 0.0
    for sample in report.get("memory", []):
        if sample["t_s"] >= next_t:
            rss, gpu = sample.get("sidecar_rss_bytes"), sample.get("gpu_used_bytes")
            memory.append(f"t={sample['t_s']:.0f}s RSS {'-' if rss is None else f'{rss / GIB:.3f}'} GiB, GPU "
                          f"{'-' if gpu is None else f'{gpu / GIB:.2f}'} GiB")
            next_t = sample["t_s"] + every_s
    lines += ["memory: " + "; ".join(memory)] if memory else []
    return lines + (pool_lines(report["pool"]) if "pool" in report else [])


def pool_lines(pool: dict) -> list[str]:
    """The pool soak's part (``soak_pool_report.py``): the kill, chunks and new streams by sidecar, the survivors'
    p99 after the kill, the audio check, the verdict."""
    restart = pool.get("restart") or {}
    lines = [f"pool: {pool['sidecars']} sidecars; sidecar {pool['killed_sidecar']} SIGKILLed at {pool['kill_t_s']} s"
             + (f", started again at {restart['t_s']} s, ready at {restart['ready_t_s']} s" if restart else "")]
    lines.append("chunks by sidecar: " + json.dumps(pool["by_sidecar"]))
    lines.append("new streams by sidecar: " + json.dumps(pool["placements"]))
    recovery = pool["p99_recovery"]
    lines.append(f"survivors' p99 by {recovery.get('window_s', '-')} s window from the kill (start s, ms): "
                 f"{[(w['start_s'], w['p99_ms']) for w in recovery['windows']]}; baseline {recovery['baseline_p99_ms']}"
                 f" ms, bound {recovery.get('bound_ms')} ms, recovered after {recovery['recovered_after_s']} s")
    lines.append("schedule slips by 10 s window (start s, count): " + str(pool["slips_by_window"]))
    if pool.get("failover") is not None:
        moved = pool["failover"]
        lines.append(f"failover: {moved['moves_after_kill']} streams moved after the kill ({moved['failovers']} "
                     f"failovers, {moved['drain_moves']} drain moves, {moved['streams_lost']} streams lost in all), "
                     f"{moved['replay_frames']} frames replayed ({moved['replay_audio_s']} s of audio); recovery_s "
                     f"p50/p99/max {moved['recovery_s']['p50']}/{moved['recovery_s']['p99']}/"
                     f"{moved['recovery_s']['max']} s; last move {moved['last_move_after_kill_s']} s after the kill; "
                     f"p99 of every chunk before/during/after the moves {moved['p99_ms']['before']}/"
                     f"{moved['p99_ms']['during']}/{moved['p99_ms']['after']} ms")
    if "audio_check" in pool:
        check = pool["audio_check"]
        groups = "; ".join(f"{name}: {g['streams']} streams, {g['chunks_compared']} chunks, "
                           f"{g['bit_identical_chunks']} bit-identical, max |diff| {g['max_abs_diff']:.3g}, "
                           f"min SNR {g['min_snr_db']:.1f} dB" for name, g in check.items() if isinstance(g, dict))
        incomplete = len(check["incomplete_on_survivors"])
        lines.append(f"audio against a decode alone (atol {check['atol']}, min SNR {check['min_snr_db']} dB): "
                     f"{groups}; survivors' streams with a chunk without audio: {incomplete}")
        for worst in check.get("worst_streams", [])[:3]:  # the streams furthest from the reference, their moves
            lines.append(f"  furthest: {json.dumps(worst)}")
    verdict = pool["verdict"]
    lines.append(("PASS " if all(verdict.values()) else "FAIL ") + json.dumps(verdict))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m code2wav.loadgen.soak_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="soak report JSON files")
    p.add_argument("--min-chunks", type=int, default=100, help="leave out windows with fewer chunks")
    p.add_argument("--every-s", type=float, default=60.0, help="memory samples this far apart")
    args = p.parse_args(argv)
    for path in args.reports:
        with open(path) as f:
            report = json.load(f)
        print(f"== {path}")
        print("\n".join(summary_lines(report, args.min_chunks, args.every_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
