"""Which process start stalls the sidecar (issue 22: p99 spikes at every client kill on the H200, and at a bare
``import torch`` process too). One sidecar (default model, bf16), CLIENTS soak client processes at STREAMS each
(open loop, 25-frame chunks), then one event every GAP_S seconds: a command run to its end while the load goes
on. Per event: how long the command ran, and the chunks sent from 1 s before it to 3 s after: p50, max, and the
longest time with no reply at all (a stall of the sidecar shows in every client at once). SIGUSR1 goes to the
sidecar at DUMP_AT_S (seconds, comma-separated) into the commands marked ``dump`` while they run (every thread's
Python stack into its log, printed at the end). ``THREADS=N`` serves with ``cpu_threads: N`` (default: the config's
``auto``, 1 on CUDA since this probe found the stall; ``THREADS=16`` is the H200 box's torch default, as before);
``OMP=1`` also sets OMP_NUM_THREADS=1 for the sidecar; ``MODEL=tests/data/golden/tiny_a
DEVICE=cpu DTYPE=float32`` is a dry run. ``python loadgen/probes/stall_probe.py``
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from code2wav.loadgen.spawn import ROOT, spawn_sidecar

PY = sys.executable
EVENTS = [  # (name, command, dump the sidecar's stacks during it)
    ("/bin/true", ["true"], False),
    ("python -c pass", [PY, "-c", "pass"], False),
    ("import numpy", [PY, "-c", "import numpy"], False),
    ("import torch", [PY, "-c", "import torch"], True),
    ("import torch, client; randint", [PY, "-c", "import torch, code2wav.client; torch.randint(0, 10, (16, 25))"],
     False),
    ("nvidia-smi", ["nvidia-smi"], False),
    ("torch.cuda.is_available()", [PY, "-c", "import torch; torch.cuda.is_available()"], False),
    ("cuda context", [PY, "-c", "import torch; torch.zeros(1, device='cuda')"], True),
]


def main() -> int:
    clients, streams = int(os.environ.get("CLIENTS", "4")), int(os.environ.get("STREAMS", "64"))
    gap_s = float(os.environ.get("GAP_S", "8"))
    dump_at_s = [float(x) for x in os.environ.get("DUMP_AT_S", "0.5,1.2").split(",")]
    work = Path(tempfile.mkdtemp(prefix="stall-probe-"))
    if os.environ.get("OMP") == "1":
        os.environ["OMP_NUM_THREADS"] = "1"
    extra = []
    if os.environ.get("THREADS"):
        (work / "threads.yaml").write_text(f"cpu_threads: {int(os.environ['THREADS'])}\n")
        extra = ["--config", str(work / "threads.yaml")]
    sidecar = spawn_sidecar(*extra, "--model", os.environ.get("MODEL", "default"),
                            "--device", os.environ.get("DEVICE", "cuda"),
                            "--dtype", os.environ.get("DTYPE", "bfloat16"), workdir=work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("OMP_NUM_THREADS", None)
    procs = [subprocess.Popen([PY, "-m", "code2wav.loadgen.soak_client", "--address", sidecar.address,
                               "--out", str(work / f"c{i}.jsonl"), "--duration-s", "3600", "--streams", str(streams),
                               "--seed", str(i)], env=env, cwd=ROOT) for i in range(clients)]
    while not all((work / f"c{i}.jsonl").exists() for i in range(clients)):
        time.sleep(0.1)
    time.sleep(10.0)  # settle
    events = []
    try:
        for name, cmd, dump in EVENTS:
            if shutil.which(cmd[0]) is None:
                continue
            t_start = time.time()
            child = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for at_s in dump_at_s if dump else ():
                time.sleep(max(0.0, t_start + at_s - time.time()))
                if child.poll() is None:
                    sidecar.proc.send_signal(signal.SIGUSR1)
            child.wait()
            events.append({"name": name, "t_start": t_start, "run_s": round(time.time() - t_start, 3), "dump": dump})
            time.sleep(max(0.0, gap_s - (time.time() - t_start)))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
        sidecar.stop()
    pairs = sorted(p for path in glob.glob(str(work / "c*.jsonl"))
                   for line in open(path) for p in json.loads(line)["latencies"])  # (t_sent, seconds)
    base = sorted(s for t, s in pairs if t < events[0]["t_start"] - 1)
    print(f"sidecar cpu_threads={os.environ.get('THREADS', 'auto')} OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}, {clients} x {streams} streams; "
          f"before the events: {len(base)} chunks, p50 {1e3 * base[len(base) // 2]:.0f} ms, "
          f"max {1e3 * base[-1]:.0f} ms")
    for ev in events:
        near = [(t, s) for t, s in pairs if ev["t_start"] - 1 <= t <= ev["t_start"] + 3]
        lat = sorted(s for _, s in near) or [float("nan")]
        replies = sorted(t + s for t, s in near)
        gap = max((b - a for a, b in zip(replies, replies[1:])), default=0.0)
        p50_s = lat[len(lat) // 2]
        print(f"{ev['name']:<32s} ran {ev['run_s']:6.2f} s  chunks {len(lat):4d}  p50 {1e3 * p50_s:6.0f} ms"
              f"  max {1e3 * lat[-1]:6.0f} ms  longest reply gap {1e3 * gap:6.0f} ms")
        if near:
            ev.update(p50_ms=round(1e3 * p50_s), max_ms=round(1e3 * lat[-1]), reply_gap_ms=round(1e3 * gap))
    out = Path(os.environ.get("OUT", str(work)))
    tag = ("omp1" if os.environ.get("OMP") == "1" else "default") + \
        (f"-threads{os.environ['THREADS']}" if os.environ.get("THREADS") else "")
    (out / f"stall-probe-{tag}.json").write_text(json.dumps(events, indent=1))
    shutil.copy(sidecar.log_path, out / f"stall-probe-{tag}-sidecar.log")
    log = sidecar.log()
    if "Thread 0x" in log or "Current thread" in log:
        print("--- sidecar stacks (SIGUSR1) ---")
        print("\n".join(line for line in log.splitlines() if line.startswith(("Thread", "Current", "  File")))[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
