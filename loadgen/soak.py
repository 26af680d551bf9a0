"""A soak with faults: open-loop real-time streams from several client processes against one sidecar, while
client processes are SIGKILLed and restarted and the sidecar is SIGTERMed and restarted once.

    python -m code2wav.loadgen.soak --model /models/qwen3/speech_tokenizer --device cuda --dtype bfloat16 \\
        --duration-s 600 --clients 4 --capacity-streams 400 --fraction 0.8 --kill-every-s 30 \\
        --restart-sidecar-at-s 300 --out soak.json

Each stream sends a chunk of ``--chunk-frames`` random codes every ``chunk_frames / frame_rate`` seconds on a
fixed schedule (open loop: not waiting for replies) for 0.5-1.5x ``--stream-frames``, then a final chunk and a new
stream. A chunk's outcome is decoded (audio of the right length), failed with a typed error (counted by code:
expected around the faults), or lost: no outcome at all from a client process that lived to the end. ``lost``
must be 0. The report (JSON): counts, p99 latency per 10 s window (all chunks; apart, those a client process sent
in its first 15 s of sending and the rest), the sidecar's own means per window (arrival -> reply, engine step,
batch wait, from ``/metrics``), the sidecar's RSS and GPU memory over time, the sidecar's time to ready after its
restart. Each client process is ``loadgen/soak_client.py``.

Faults across a pool: ``--sidecars 3 --kill-sidecar-at-s 60 --restart-killed-at-s 100 --check-slots 1`` starts
three sidecars (``soak_sidecars.py``), each client process a ``SidecarPool`` over them, SIGKILLs one at 60 s and
starts it again at 100 s; the report's ``pool`` part (``soak_pool_report.py``) gives the chunks by sidecar, the new
streams per sidecar before the kill, after it and after the restart, the survivors' p99 after the kill against
before, the recorded streams decoded again alone and compared (``soak_check.py``), and a ``verdict`` (the exit
code is 1 unless every mark holds). ``.ci/gpu-phases/soak-pool`` runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import MappingProxyType

from code2wav.sidecar.cli_checks import fail, run_guarded

from .soak_check import reference_check
from .soak_options import soak_parser
from .soak_pool_report import pool_section
from .soak_report import p99_windows, read_client, sent_failures, server_windows
from .soak_sidecars import SoakSidecars
from .spawn import ROOT, SpawnedSidecar

SAMPLE_EVERY_S = 1.0
SERVER_EVERY = 5  # /metrics scraped every 5th sample (5 s): a scrape holds the sidecar's GIL for a few ms
NEW_CLIENT_S = 15.0  # a client process's chunks in its first seconds of sending: reported apart (p99_by_window_new)
CHECK_TOLERANCE = MappingProxyType({"float32": (1e-5, None), "bfloat16": (None, 20.0), "float16": (None, 20.0)})
"""(``--check-atol``, ``--check-min-snr-db``) by dtype: how far a chunk decoded in the soak's batches may be from
the same chunk decoded alone. float32: the exact mode's 1e-5 (tests/test_streaming_kit.py; on CUDA 1e-4, as
tests/test_cuda_graphs.py holds a graph's decode); bfloat16: 20 dB, 10 dB under the exact mode's distance from
float32 (30 dB, docs/performance.md), far above a wrong stream's ~0 dB."""


# ------------------------------------------------------------------ the driver
def _client_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


SPAWN_PROBE = "import torch, code2wav.client; torch.randint(0, 10, (16, 25))"
"""What a client process does before its first chunk, alone: ``--spawn-probe-every-s`` starts one such process
now and then, with no client killed or added, to tell a new process's start from the rest of a kill."""


def _start_client(args: argparse.Namespace, address: str, workdir: Path, index: int, generation: int
                  ) -> tuple[subprocess.Popen, Path]:
    """A client process; it runs until the driver's SIGTERM (then it collects every outcome and exits)."""
    out = workdir / f"client{index}-{generation}.jsonl"
    env = _client_env()
    cmd = [sys.executable, "-m", "code2wav.loadgen.soak_client", "--address", address, "--out", str(out),
           "--duration-s", f"{args.duration_s + 3600:.0f}", "--streams", str(args.streams_per_client),
           "--chunk-frames", str(args.chunk_frames), "--stream-frames", str(args.stream_frames),
           "--timeout-s", str(args.timeout_s), "--seed", str(index * 1000 + generation)]
    if args.frame_rate_hz:
        cmd += ["--frame-rate-hz", str(args.frame_rate_hz)]
    if args.check_slots:
        cmd += ["--check-slots", str(args.check_slots), "--check-out", str(out.with_suffix(".check.pt"))]
    if args.no_failover:
        cmd.append("--no-failover")
    return subprocess.Popen(cmd, env=env, cwd=ROOT), out


def run_soak(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="code2wav-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sidecar_args = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, *args.sidecar_arg]
    fleet = SoakSidecars(sidecar_args, workdir, args.sidecars, {args.kill_sidecar: args.killed_sidecar_arg})
    address = ",".join(fleet.addresses)  # several: each client process is a SidecarPool over all of them
    clients = [_start_client(args, address, workdir, i, 0) for i in range(args.clients)]
    _wait_connected(clients, fleet.running, timeout_s=300)  # the clock starts once every client is connected
    t0_wall, t0 = time.time(), time.monotonic()
    print(f"soak: {args.clients} clients connected to {args.sidecars} sidecar(s); the {args.duration_s:.0f} s clock "
          "starts", flush=True)
    end_at = t0 + args.duration_s
    generations = [0] * args.clients
    outputs: list[Path] = [out for _, out in clients]
    killed: list[Path] = []
    samples, kills = [], []
    restart: dict = {}
    sidecar_kill: dict = {}
    restart_killed: dict = {}
    threads: list[threading.Thread] = []
    next_kill = t0 + args.kill_every_s if args.kill_every_s else float("inf")
    # half a period in: with --kill-every-s of the same period, probes fall midway between kills
    next_probe = t0 + args.spawn_probe_every_s / 2 if args.spawn_probe_every_s else float("inf")
    probes: list[dict] = []
    crashed: list[dict] = []  # client processes that exited before the driver killed or stopped them
    next_sample = t0
    victim = 0
    while time.monotonic() < end_at:
        now = time.monotonic()
        if now >= next_sample:
            samples.append(fleet.sample(round(now - t0, 2), args.device != "cpu", len(samples) % SERVER_EVERY == 0))
            next_sample += SAMPLE_EVERY_S
        for index, (proc, out) in enumerate(clients):  # a client that died on its own is a finding, not a kill
            if proc.poll() is not None and not any(c["output"] == out.name for c in crashed):
                crashed.append({"t_s": round(now - t0, 2), "client": index, "output": out.name,
                                "exit_code": proc.returncode})
        if now >= next_kill and end_at - now > 2.0:
            proc, out = clients[victim]
            proc.kill()  # SIGKILL: no bye, its streams are reaped by the TTL
            proc.wait()
            killed.append(out)
            generations[victim] += 1
            clients[victim] = _start_client(args, address, workdir, victim, generations[victim])
            outputs.append(clients[victim][1])
            kills.append({"t_s": round(now - t0, 2), "client": victim})
            victim = (victim + 1) % args.clients
            next_kill += args.kill_every_s
        if now >= next_probe and end_at - now > 2.0:  # a process start alone, no client killed or added
            subprocess.Popen([sys.executable, "-c", SPAWN_PROBE], cwd=ROOT, env=_client_env())
            probes.append({"t_s": round(now - t0, 2)})
            next_probe += args.spawn_probe_every_s
        if args.restart_sidecar_at_s is not None and not restart and now - t0 >= args.restart_sidecar_at_s:
            restart["pending"] = True
            threads.append(threading.Thread(target=fleet.drain_and_restart, args=(0, t0, restart)))
            threads[-1].start()  # (sampling and kills go on meanwhile)
        if args.kill_sidecar_at_s is not None and not sidecar_kill and now - t0 >= args.kill_sidecar_at_s:
            fleet.kill(args.kill_sidecar)
            sidecar_kill.update({"t_s": round(time.monotonic() - t0, 3), "sidecar": args.kill_sidecar})
            print(f"soak: sidecar {args.kill_sidecar} SIGKILLed at {sidecar_kill['t_s']} s", flush=True)
        if sidecar_kill and args.restart_killed_at_s is not None and not restart_killed \
                and now - t0 >= args.restart_killed_at_s:
            restart_killed["pending"] = True
            threads.append(threading.Thread(target=fleet.restart, args=(args.kill_sidecar, t0, restart_killed)))
            threads[-1].start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    restart.pop("pending", None)
    restart_killed.pop("pending", None)
    for proc, _ in clients:
        proc.send_signal(signal.SIGTERM)
    for proc, _ in clients:
        proc.wait(timeout=args.timeout_s + 60)
    check = (reference_check(fleet.addresses, fleet.alive(), outputs, workdir / "check.json", _client_env())
             if args.check_slots else None)
    fleet.stop()
    per_client = {str(path.name): read_client(path) for path in outputs}
    crashed_names = {c["output"] for c in crashed}  # died on their own: their chunks in flight are not "lost"
    lived = {p.name for p in outputs if p not in killed and p.name not in crashed_names}
    survivors = [per_client[name] for name in lived]
    failed: dict[str, int] = {}
    failed_unsent: dict[str, int] = {}
    for stats in per_client.values():
        for code, count in stats["failed"].items():
            failed[code] = failed.get(code, 0) + count
        for code, count in stats["failed_unsent"].items():
            failed_unsent[code] = failed_unsent.get(code, 0) + count
    lost = sum(s["sent"] - s["decoded"] - s["bad_audio"] - sent_failures(s) for s in survivors)
    latencies = [entry for stats in per_client.values() for entry in stats["latencies"]]
    new, settled = [], []  # chunks a client process sent in its first NEW_CLIENT_S seconds of sending, the rest
    for stats in per_client.values():
        first_sent = min((entry[0] for entry in stats["latencies"]), default=0.0)
        for entry in stats["latencies"]:
            (new if entry[0] - first_sent < NEW_CLIENT_S else settled).append(entry)
    report = {
        "duration_s": args.duration_s, "clients": args.clients, "streams_per_client": args.streams_per_client,
        "sidecars": args.sidecars, "chunk_frames": args.chunk_frames, "device": args.device, "dtype": args.dtype,
        "sent": sum(s["sent"] for s in per_client.values()),
        "decoded": sum(s["decoded"] for s in per_client.values()),
        "failed": failed, "failed_unsent": failed_unsent, "bad_audio": sum(s["bad_audio"] for s in per_client.values()),
        "lost": lost, "survivors": {"processes": len(survivors), "sent": sum(s["sent"] for s in survivors),
                                    "decoded": sum(s["decoded"] for s in survivors),
                                    "failed": sum(sent_failures(s) for s in survivors)},
        "all_survivors_exited": all(s["exited"] for s in survivors),
        "kills": kills, "crashed_clients": crashed, "spawn_probes": probes, "sidecar_restart": restart,
        "p99_by_window": p99_windows(latencies, t0_wall),
        "p99_by_window_settled": p99_windows(settled, t0_wall), "p99_by_window_new": p99_windows(new, t0_wall),
        "server_by_window": server_windows(samples),
        "memory": [{k: v for k, v in s.items() if k not in ("server", "servers")} for s in samples],
        "workdir": str(workdir),
    }
    if args.sidecars > 1:
        report["server_by_window_by_sidecar"] = [
            server_windows([{"t_s": s["t_s"], "server": s["servers"][index]} for s in samples])
            for index in range(args.sidecars)]
    if sidecar_kill:
        report["pool"] = pool_section(args.sidecars, args.kill_sidecar, per_client, lived, latencies, t0_wall,
                                      args.duration_s, sidecar_kill, restart_killed, check, args.check_atol,
                                      args.check_min_snr_db)
    return report


def _wait_connected(clients: list[tuple[subprocess.Popen, Path]], sidecars: list[SpawnedSidecar],
                    timeout_s: float) -> None:
    """Until every client process has written its first line (connected); a client that exits first, or a start
    past ``timeout_s``, ends the soak here (it would measure fewer clients than asked)."""
    deadline = time.monotonic() + timeout_s
    while not all(out.exists() and out.stat().st_size for _, out in clients):
        dead = [f"{out.name} (exit code {proc.returncode})" for proc, out in clients if proc.poll() is not None]
        dead += [f"a sidecar (exit code {s.proc.returncode}; its log: {s.log_path})" for s in sidecars
                 if s.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            for proc, _ in clients:
                proc.kill()
                proc.wait()
            for sidecar in sidecars:
                sidecar.stop()
            raise SystemExit("soak: client processes did not connect: "
                             + (", ".join(dead) or f"not all within {timeout_s:.0f} s"))
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = soak_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.streams_per_client is None:
        if args.capacity_streams is None:
            return fail("give --streams-per-client, or --capacity-streams (and --fraction)")
        args.streams_per_client = max(1, round(args.capacity_streams * args.fraction / args.clients))
    if args.kill_sidecar_at_s is not None and not (args.sidecars >= 2 and args.kill_sidecar < args.sidecars):
        return fail("--kill-sidecar-at-s needs --sidecars 2 or more and --kill-sidecar below --sidecars")
    if args.restart_killed_at_s is not None and (args.kill_sidecar_at_s is None
                                                 or args.restart_killed_at_s <= args.kill_sidecar_at_s):
        return fail("--restart-killed-at-s needs --kill-sidecar-at-s, and a later time")
    atol, min_snr_db = CHECK_TOLERANCE[args.dtype]
    if atol is not None and args.device != "cpu":
        atol = 1e-4
    args.check_atol = atol if args.check_atol is None else args.check_atol
    args.check_min_snr_db = min_snr_db if args.check_min_snr_db is None else args.check_min_snr_db
    return run_guarded("soak", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    report = run_soak(args)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    summary = {k: report[k] for k in ("sent", "decoded", "failed", "bad_audio", "lost", "crashed_clients",
                                      "sidecar_restart")}
    if "pool" in report:
        summary["pool_verdict"] = report["pool"]["verdict"]
    print(json.dumps(summary))
    passed = all(report["pool"]["verdict"].values()) if "pool" in report else True
    return 0 if report["lost"] == 0 and report["bad_audio"] == 0 and not report["crashed_clients"] and passed else 1


if __name__ == "__main__":
    sys.exit(main())
