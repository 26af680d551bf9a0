"""The pool soak's report (``loadgen/soak.py --sidecars N --kill-sidecar-at-s T``): what the kill of one sidecar
did to the others. Pure functions of what the soak collected; times are seconds from the soak's clock start.

- ``by_sidecar``: chunks sent, decoded, failed (by code), lost, by the sidecar they went to. ``lost`` counts only
  client processes that lived to the end; on the killed sidecar the chunks in flight end with a typed error
  (``stream_lost``), counted under ``failed``, never as lost.
- ``placements``: new streams per sidecar before the kill, between the kill and the restart (its ready line),
  and after it.
- ``p99_recovery``: the p99 latency of the survivors' chunks (by the time they were sent) in windows of WINDOW_S
  (10 s) aligned at the kill, up to the restart, against their p99 in the BASELINE_S before the kill;
  ``recovered_after_s`` is the end of the last window above the bound (RECOVERY_FACTOR x that baseline, at least
  RECOVERY_SLACK_MS above it), measured from the kill: 0 if none was above, 10 if only the kill's own window.
  Windows of 10 s, not less: a p99 over a few hundred chunks, not the largest few of a CPU run's scheduling noise.
- ``slips_by_window``: times a client's stream fell behind its schedule (a chunk not sent when due: e.g. the client
  process waited on an ``open_stream`` placed on the dead sidecar before its silence was noticed), per WINDOW_S
  from the soak's start; latency is measured from the send, so a slip shows here, not in the p99.
- ``audio_check``: the reference decode of ``soak_check.py``, by group (the survivors' streams, those of them open
  across the kill, the killed sidecar's streams up to the kill, the restarted one's).
- ``failover`` (the clients' pools fail over, the default): the moves the kill caused, summed over the clients'
  ``failover_stats``: streams moved, frames replayed, each move's ``recovery_s`` (its start to the replay's last
  reply: what its chunk in flight waited on top of its decode) as p50/p99/max, the last move's end after the kill,
  streams lost; and the p99 of every chunk (moved streams' included) in the windows before, during and after the
  moves. With failover the killed sidecar's chunks in flight complete elsewhere: its ``failed`` must stay empty.
"""

from __future__ import annotations

from .soak_report import WINDOW_S

BASELINE_S = 20.0
RECOVERY_FACTOR = 2.0
RECOVERY_SLACK_MS = 25.0  # a bound at least this far above the baseline (a CPU run's baseline is ~20 ms)
RECOVERY_LIMIT_S = 10.0  # the pass mark: survivors' p99 back under the bound within this long after the kill
MIN_WINDOW_CHUNKS = 10  # a window with fewer chunks has no meaningful p99 (left out)


def by_sidecar(per_client: dict[str, dict], lived: set[str], count: int) -> list[dict]:
    totals = [{"sent": 0, "decoded": 0, "bad_audio": 0, "failed": {}, "lost": 0} for _ in range(count)]
    for name, stats in per_client.items():
        for index, counts in stats["by_sidecar"].items():
            total = totals[int(index)]
            for key in ("sent", "decoded", "bad_audio"):
                total[key] += counts[key]
            for code, number in counts["failed"].items():
                total["failed"][code] = total["failed"].get(code, 0) + number
            if name in lived:
                outcomes = counts["decoded"] + counts["bad_audio"] + sum(counts["failed"].values())
                total["lost"] += counts["sent"] - outcomes
    return totals


def placements(per_client: dict[str, dict], t0_wall: float, count: int, kill_t_s: float,
               ready_t_s: float | None) -> dict[str, list[int]]:
    """New streams per sidecar index in each phase: ``before_kill``, ``after_kill`` (until the restarted one is
    ready, or the end), ``after_restart``."""
    phases = {"before_kill": [0] * count, "after_kill": [0] * count, "after_restart": [0] * count}
    for stats in per_client.values():
        for t_wall, index in stats["placements"]:
            t_s = t_wall - t0_wall
            phase = "before_kill" if t_s < kill_t_s else (
                "after_kill" if ready_t_s is None or t_s < ready_t_s else "after_restart")
            phases[phase][index] += 1
    return phases


def slips_by_window(per_client: dict[str, dict], t0_wall: float) -> list[list[float]]:
    """(window start s, slips) per WINDOW_S from the soak's start, windows with none left out."""
    counts: dict[int, int] = {}
    for stats in per_client.values():
        for t_wall in stats["slips"]:
            counts[int((t_wall - t0_wall) // WINDOW_S)] = counts.get(int((t_wall - t0_wall) // WINDOW_S), 0) + 1
    return [[index * WINDOW_S, count] for index, count in sorted(counts.items())]


def _p99_ms(values: list[float]) -> float:
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def p99_recovery(latencies: list[list[float]], t0_wall: float, killed: int, kill_t_s: float,
                 until_t_s: float) -> dict:
    """``latencies``: (wall time sent, seconds, sidecar index) of every decoded chunk; only the survivors' count."""
    survivors = [(t_wall - t0_wall, seconds) for t_wall, seconds, index in latencies if index != killed]
    baseline = [seconds for t_s, seconds in survivors if kill_t_s - BASELINE_S <= t_s < kill_t_s]
    if len(baseline) < MIN_WINDOW_CHUNKS:
        return {"baseline_p99_ms": None, "windows": [], "recovered_after_s": None}  # no baseline: no verdict
    baseline_ms = _p99_ms(baseline)
    bound_ms = max(RECOVERY_FACTOR * baseline_ms, baseline_ms + RECOVERY_SLACK_MS)
    windows: dict[int, list[float]] = {}
    for t_s, seconds in survivors:
        if kill_t_s <= t_s < until_t_s:
            windows.setdefault(int((t_s - kill_t_s) // WINDOW_S), []).append(seconds)
    shown = [{"start_s": round(index * WINDOW_S, 1), "chunks": len(values), "p99_ms": round(_p99_ms(values), 2)}
             for index, values in sorted(windows.items()) if len(values) >= MIN_WINDOW_CHUNKS]
    over = [w["start_s"] + WINDOW_S for w in shown if w["p99_ms"] > bound_ms]
    return {"baseline_p99_ms": round(baseline_ms, 2), "bound_ms": round(bound_ms, 2), "window_s": WINDOW_S,
            "windows": shown, "recovered_after_s": max(over, default=0.0) if shown else None}


def _group(results: list[dict]) -> dict:
    return {"streams": len(results), "chunks_compared": sum(r["chunks_compared"] for r in results),
            "bit_identical_chunks": sum(r["bit_identical_chunks"] for r in results),
            "max_abs_diff": max((r["max_abs_diff"] for r in results), default=0.0),
            "min_snr_db": min((r["min_snr_db"] for r in results), default=float("inf"))}


def _within(result: dict, atol: float | None, min_snr_db: float | None) -> bool:
    return ((atol is None or result["max_abs_diff"] <= atol)
            and (min_snr_db is None or result["min_snr_db"] >= min_snr_db))


def audio_check(results: list[dict], t0_wall: float, killed: int, kill_t_s: float, ready_t_s: float | None,
                atol: float | None, min_snr_db: float | None) -> dict:
    """The reference decode's results (``soak_check.py``) by group; ``within_tolerance``: every chunk compared
    is within ``atol`` and at least ``min_snr_db`` (None: not judged by it); ``incomplete_on_survivors``:
    survivors' streams with a chunk that got no audio. (JSON writes an infinite SNR, all bit-identical, as
    Infinity.)"""
    kill_wall = t0_wall + kill_t_s
    survivors = [r for r in results if r["sidecar"] != killed]
    on_killed = [r for r in results if r["sidecar"] == killed]
    restarted = [r for r in on_killed if ready_t_s is not None and r["t_open"] - t0_wall >= ready_t_s]
    groups = {
        "survivors": _group(survivors),
        "survivors_open_across_kill": _group([r for r in survivors if r["t_open"] < kill_wall <= r["t_last_sent"]]),
        "killed_up_to_kill": _group([r for r in on_killed if r not in restarted]),
        "restarted": _group(restarted),
    }
    return {"atol": atol, "min_snr_db": min_snr_db, **groups,
            "within_tolerance": all(_within(r, atol, min_snr_db) for r in results),
            "incomplete_on_survivors": [r["stream_id"] for r in survivors if r["chunks_compared"] < r["chunks_sent"]]}


def worst_streams(results: list[dict], per_client: dict[str, dict], t0_wall: float, count: int = 5) -> list[dict]:
    """The ``count`` recorded streams furthest from their reference decode (lowest chunk SNR first), each with
    its worst chunk (index, seconds from the soak's start) and the moves its pool made of it (reason, seconds from
    the start, frames replayed): a failed audio check says which stream, which chunk, and whether a move preceded
    it."""
    moves: dict[str, list[dict]] = {}
    for client in per_client.values():
        for move in (client.get("failover") or {}).get("recent", []):
            moves.setdefault(move["stream_id"], []).append(
                {"reason": move["reason"], "done_t_s": round(move["at_s"] - t0_wall, 2),
                 "replay_frames": move["replay_frames"], "recovery_s": round(move["recovery_s"], 3)})
    ranked = sorted((r for r in results if r["chunks_compared"]), key=lambda r: r["min_snr_db"])[:count]
    return [{"stream_id": r["stream_id"], "sidecar": r["sidecar"], "chunks_compared": r["chunks_compared"],
             "min_snr_db": round(r["min_snr_db"], 2), "max_abs_diff": r["max_abs_diff"],
             "worst_chunk": r.get("worst_chunk"),
             "worst_chunk_t_s": None if r.get("worst_chunk_t_sent") is None
             else round(r["worst_chunk_t_sent"] - t0_wall, 2),
             "open_t_s": round(r["t_open"] - t0_wall, 2), "moves": moves.get(r["stream_id"], [])}
            for r in ranked]


def failover(per_client: dict[str, dict], latencies: list[list[float]], t0_wall: float, kill_t_s: float) -> dict | None:
    """The ``failover`` part (None: the clients' pools did not fail over)."""
    stats = [c["failover"] for c in per_client.values() if c.get("failover") is not None]
    if not stats:
        return None
    kill_wall = t0_wall + kill_t_s
    moves = [m for s in stats for m in s.get("recent", []) if m["reason"] == "failover" and m["at_s"] >= kill_wall]
    recovery = sorted(m["recovery_s"] for m in moves)
    last_s = max((m["at_s"] - kill_wall for m in moves), default=0.0)

    def p99(since_s: float, until_s: float) -> float | None:
        values = [seconds for t_wall, seconds, *_ in latencies if since_s <= t_wall - t0_wall - kill_t_s < until_s]
        return round(_p99_ms(values), 2) if len(values) >= MIN_WINDOW_CHUNKS else None
    return {"failovers": sum(s["failovers"] for s in stats), "drain_moves": sum(s["drain_moves"] for s in stats),
            "streams_lost": sum(s["streams_lost"] for s in stats), "moves_after_kill": len(moves),
            "replay_frames": sum(m["replay_frames"] for m in moves),
            "replay_audio_s": round(sum(m["replay_audio_s"] for m in moves), 1),
            "recovery_s": {"p50": round(recovery[len(recovery) // 2], 3) if recovery else None,
                           "p99": round(recovery[min(len(recovery) - 1, int(0.99 * len(recovery)))], 3)
                           if recovery else None, "max": round(recovery[-1], 3) if recovery else None},
            "last_move_after_kill_s": round(last_s, 2),
            "p99_ms": {"before": p99(-BASELINE_S, 0.0), "during": p99(0.0, max(last_s, WINDOW_S)),
                       "after": p99(max(last_s, WINDOW_S), max(last_s, WINDOW_S) + BASELINE_S)}}


def verdict(pool: dict) -> dict[str, bool]:
    """Each pass mark of the pool soak (all True: it passed)."""
    killed = pool["killed_sidecar"]
    survivors = [counts for index, counts in enumerate(pool["by_sidecar"]) if index != killed]
    marks = {
        "survivors_lost_0": all(s["lost"] == 0 for s in survivors),
        "survivors_failed_0": all(not s["failed"] and s["bad_audio"] == 0 for s in survivors),
        "killed_failed_only_stream_lost": set(pool["by_sidecar"][killed]["failed"]) <= {"stream_lost"},
        "no_placement_on_killed_while_down": pool["placements"]["after_kill"][killed] == 0,
        "p99_recovered_within_10_s": (pool["p99_recovery"]["recovered_after_s"] is not None
                                      and pool["p99_recovery"]["recovered_after_s"] <= RECOVERY_LIMIT_S),
    }
    if pool.get("restart"):
        marks["placed_on_restarted"] = pool["placements"]["after_restart"][killed] > 0
    if pool.get("failover") is not None:  # moved, not lost: nothing failed on the killed sidecar either
        marks["failover_no_stream_lost"] = (pool["failover"]["streams_lost"] == 0
                                            and not pool["by_sidecar"][killed]["failed"])
    if pool.get("audio_check"):
        check = pool["audio_check"]
        across = check["survivors_open_across_kill"]["streams"]
        marks["audio_within_tolerance"] = check["within_tolerance"] and across > 0  # and the kill had some to test
        marks["survivors_streams_complete"] = not check["incomplete_on_survivors"]
    return marks


def pool_section(count: int, killed: int, per_client: dict[str, dict], lived: set[str], latencies: list[list[float]],
                 t0_wall: float, duration_s: float, kill: dict, restart: dict, check: list[dict] | None,
                 atol: float | None, min_snr_db: float | None) -> dict:
    """The report's ``pool`` part and its ``verdict``."""
    ready_t_s = restart.get("ready_t_s")
    pool = {"sidecars": count, "killed_sidecar": killed, "kill_t_s": kill["t_s"], "restart": restart or None,
            "by_sidecar": by_sidecar(per_client, lived, count),
            "placements": placements(per_client, t0_wall, count, kill["t_s"], ready_t_s),
            "slips_by_window": slips_by_window(per_client, t0_wall),
            "p99_recovery": p99_recovery(latencies, t0_wall, killed, kill["t_s"], restart.get("t_s", duration_s)),
            "failover": failover(per_client, latencies, t0_wall, kill["t_s"])}
    if check is not None:
        pool["audio_check"] = audio_check(check, t0_wall, killed, kill["t_s"], ready_t_s, atol, min_snr_db)
        pool["audio_check"]["worst_streams"] = worst_streams(check, per_client, t0_wall)
    pool["verdict"] = verdict(pool)
    return pool
