"""``code2wav-sidecar bench --transport``: what the wire costs, inline bytes vs CUDA IPC, per chunk.

Codes start on the GPU (where a talker leaves them) and audio must end on the GPU. Three ways, same run,
same device, model, dtype and chunk shape:

- ``in-process``: the sidecar's own decode without the wire: codes to the host, one CUDA-graph replay,
  audio rows copied out on the device (what the sidecar does for an IPC chunk).
- ``inline``: the sidecar over ZeroMQ with ``cuda_ipc=False``: codes copied to the host and sent as bytes,
  audio returned as bytes and copied back to the GPU.
- ``ipc``: the sidecar with CUDA IPC: codes copied into the client's registered region, only offsets travel,
  audio written by the sidecar straight into the client's region.

At concurrency 1 a chunk's overhead is its p50 minus the in-process p50. At concurrency C the sidecar
batches up to ``B`` chunks per step, so the in-process reference for one chunk's round trip is
``C / B`` steps at batch ``B``; the overhead is the p50 minus that. The sidecar runs with a batching window
of 0 here, so the window's deliberate wait is not counted as wire cost.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from client import SidecarClient

from .spawn import spawn_sidecar
from .traffic import synthetic_codes


def _percentiles(times_s: list[float]) -> tuple[float, float]:
    ordered = sorted(times_s)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3


def in_process(model, chunk_frames: int, batches: tuple[int, ...], iters: int) -> dict[int, float]:
    """p50 ms of one exact graph step per batch size, GPU codes in, GPU audio out (copied once, as for IPC)."""
    from prometheus_client import CollectorRegistry

    from sidecar.engine import DecodeItem
    from sidecar.graphs.manager import GraphManager
    from sidecar.graphs.plan import BucketKey
    from sidecar.metrics import Metrics
    from sidecar.models.routine import StreamRoutine
    from sidecar.state_store import StateArena

    arena = StateArena(model.module.state_layout(), max(batches), model.dtype, model.device)
    buckets = tuple(BucketKey("exact", b, chunk_frames) for b in batches)
    manager = GraphManager({"exact": StreamRoutine(model, arena, max(batches), chunk_frames)}, buckets,
                           model.device, Metrics(CollectorRegistry()), max_graph_memory_bytes=None)
    manager.capture_startup()
    codes = synthetic_codes(model.num_quantizers, chunk_frames, model.codebook_size, seed=3).to(model.device)
    out: dict[int, float] = {}
    for key in buckets:
        slots = [arena.allocate() for _ in range(key.batch)]

        def step() -> None:
            host = codes.cpu()  # [Q, n]: the engine reads codes on the host (and checks them there)
            items = [DecodeItem(codes=host, slot=s, skip_frames=0, out_device=True) for s in slots]
            kept = [audio.clone() for audio in manager.run(key, items)]  # [n * U] each, on the device
            torch.cuda.synchronize()
            del kept

        for _ in range(10):
            step()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[key.batch] = _percentiles(times)[0]
        for s in slots:
            arena.release(s)
    return out


def _drive(address: str, use_ipc: bool, concurrency: int, chunks_per_stream: int, chunk_frames: int,
           num_quantizers: int, codebook_size: int) -> tuple[list[float], dict]:
    latencies: list[float] = []
    lock = threading.Lock()
    with SidecarClient(address, timeout_s=120, cuda_ipc=use_ipc) as client:
        codes = synthetic_codes(num_quantizers, chunk_frames, codebook_size, seed=4).cuda()

        def one(index: int) -> None:
            stream = client.open_stream(f"t-{int(use_ipc)}-{concurrency}-{index}")
            mine = []
            for i in range(chunks_per_stream + 5):
                t0 = time.perf_counter()
                audio = stream.decode(codes)
                assert audio.is_cuda
                torch.cuda.current_stream().synchronize()
                if i >= 5:  # warm-up: registration, first replays
                    mine.append(time.perf_counter() - t0)
                del audio
            stream.abort()
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = client.ipc_stats
    return latencies, stats


def run(args) -> int:
    from sidecar.models import configure_cuda, load_model, resolve_device

    device = resolve_device(args.device)
    if device.type != "cuda":
        print("bench --transport compares CUDA IPC with inline bytes: it needs a CUDA device")
        return 2
    configure_cuda()
    levels = [int(x) for x in args.concurrency.split(",") if x]
    model = load_model(args.model, device, args.dtype)
    q, k = model.num_quantizers, model.codebook_size
    batch_cap = args.transport_batch
    ref = in_process(model, args.chunk_frames, tuple(sorted({1, batch_cap})), args.baseline_iters)
    del model
    torch.cuda.empty_cache()
    workdir = Path(tempfile.mkdtemp(prefix="code2wav-transport-"))
    config = workdir / "sidecar.yaml"
    config.write_text(f"scheduler:\n  batch_window_us: 0\n  max_batch_size: {batch_cap}\n")
    spawned = spawn_sidecar("--model", args.model, "--device", str(device), "--dtype", args.dtype,
                            "--config", str(config), *args.serve_arg, workdir=workdir)
    print(spawned.ready_line, flush=True)
    rows = []
    try:
        for level in levels:
            per_stream = max(10, args.transport_chunks // level)
            for transport in ("inline", "ipc"):
                times, stats = _drive(spawned.address, transport == "ipc", level, per_stream, args.chunk_frames, q, k)
                p50, p95 = _percentiles(times)
                steps = level / min(level, batch_cap)
                reference = ref[1] if level == 1 else steps * ref[batch_cap]
                rows.append({"transport": transport, "concurrency": level, "chunks": len(times), "p50_ms": p50,
                             "p95_ms": p95, "in_process_ms": reference, "overhead_p50_us": (p50 - reference) * 1e3,
                             "ipc_chunks": stats.get("ipc_chunks", 0),
                             "fallbacks": {k2: v for k2, v in stats.items() if k2.startswith("inline_fallback")}})
    finally:
        spawned.stop()
    print(f"\nin-process graph step (GPU codes -> GPU audio), {args.chunk_frames} frames: "
          + ", ".join(f"b{b} {ms:.3f} ms" for b, ms in ref.items()))
    print(f"{'transport':>9} {'conc':>5} {'chunks':>7} {'p50_ms':>8} {'p95_ms':>8} {'inproc_ms':>9} "
          f"{'overhead_us':>11} {'ipc_chunks':>10}")
    for r in rows:
        print(f"{r['transport']:>9} {r['concurrency']:>5} {r['chunks']:>7} {r['p50_ms']:>8.3f} {r['p95_ms']:>8.3f} "
              f"{r['in_process_ms']:>9.3f} {r['overhead_p50_us']:>11.0f} {r['ipc_chunks']:>10} {r['fallbacks'] or ''}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"in_process_ms": ref, "rows": rows,
                                                    "settings": {"dtype": args.dtype, "model": args.model,
                                                                 "chunk_frames": args.chunk_frames,
                                                                 "batch_cap": batch_cap}}, indent=2))
        print(f"wrote {args.json_path}")
    return 0
