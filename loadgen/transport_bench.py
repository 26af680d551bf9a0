"""``code2wav-sidecar bench --transport``: what the wire costs, inline bytes vs CUDA IPC, per chunk.

Codes start on the GPU (where a talker leaves them) and audio must end on the GPU. Three ways, same run,
same device, model, dtype and chunk shape:

- ``in-process``: the sidecar's own decode without the wire: codes to the host, one CUDA-graph replay,
  audio rows copied out on the device (what the sidecar does for an IPC chunk).
- ``inline``: the sidecar over ZeroMQ with ``cuda_ipc=False``: codes copied to the host and sent as bytes,
  audio returned as bytes and copied back to the GPU.
- ``ipc``: the sidecar with CUDA IPC: codes copied into the client's registered region, only offsets travel,
  audio written by the sidecar straight into the client's region.

At concurrency 1 a chunk's overhead is its p50 minus the p50 of in-process steps run in this process in blocks
between blocks of its chunks (the GPU's speed drifts over a run by more than the wire costs, so the two are
interleaved). At concurrency C the sidecar batches up to ``B`` chunks per step, so the in-process reference for
one chunk's round trip is ``C / B`` steps at batch ``B``, measured right before and after the inline/ipc pair;
the overhead is the p50 minus that. The sidecar runs with a batching window
of 0 here, so the window's deliberate wait is not counted as wire cost. A chunk's round trip ends when its audio
is ready on the GPU: the one caller at concurrency 1 spins in its CUDA sync (as a runner's one thread does);
concurrent callers sleep in theirs, since dozens of spinning threads starve the sidecar and the client's I/O
thread of CPUs (that made partial batches and a p95 tail of one more step).
"""

from __future__ import annotations

import json
import statistics
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from code2wav.client import SidecarClient

from .server_metrics import metric_value
from .phases import Progress, Step
from .spawn import spawn_sidecar
from .traffic import synthetic_codes


def _percentiles(times_s: list[float]) -> tuple[float, float]:
    ordered = sorted(times_s)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3


class InProcessReference:
    """One exact graph step per batch size, GPU codes in, GPU audio out (copied once, as for IPC), in this
    process. Kept alive during the sidecar runs and measured close in time to them (in blocks between blocks of
    chunks at concurrency 1, else right before and after each transport pair), so a drift of the GPU's clocks
    over the run does not show up as wire cost."""

    def __init__(self, model, chunk_frames: int, batches: tuple[int, ...]) -> None:
        from prometheus_client import CollectorRegistry

        from code2wav.sidecar.graphs.manager import GraphManager
        from code2wav.sidecar.graphs.plan import BucketKey
        from code2wav.sidecar.metrics import Metrics
        from code2wav.sidecar.graphs.routine import StreamRoutine
        from code2wav.sidecar.state_store import StateArena

        self.arena = StateArena(model.module.state_layout(), max(batches), model.dtype, model.device)
        self.buckets = {b: BucketKey("exact", b, chunk_frames) for b in batches}
        self.manager = GraphManager({"exact": StreamRoutine(model, self.arena, max(batches), chunk_frames)},
                                    tuple(self.buckets.values()), model.device, Metrics(CollectorRegistry()),
                                    max_graph_memory_bytes=None)
        self.manager.capture_startup()
        self.codes = synthetic_codes(model.num_quantizers, chunk_frames, model.codebook_size, seed=3).to(model.device)
        self.slots = [self.arena.allocate() for _ in range(max(batches))]

    def step_s(self, batch: int) -> float:
        """Seconds of one step at ``batch``, from the host read of the codes to the device being done."""
        from code2wav.sidecar.engine import DecodeItem

        t0 = time.perf_counter()
        host = self.codes.cpu()  # [Q, n]: the engine reads codes on the host (and checks them there)
        items = [DecodeItem(codes=host, slot=s, skip_frames=0, out_device=True) for s in self.slots[:batch]]
        kept = [audio.clone() for audio in self.manager.replay(self.buckets[batch], items)]  # [n * U] each, on device
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        del kept
        return seconds

    def p50_ms(self, batch: int, iters: int) -> float:
        for _ in range(10):
            self.step_s(batch)
        return _percentiles([self.step_s(batch) for _ in range(iters)])[0]


_BLOCK = 50
"""Chunks per block at concurrency 1; the in-process reference runs as many steps after each block."""

_COUNTERS = {"deferred": ("code2wav_sidecar_ipc_codes_deferred_total", {}),
             "polled": ("code2wav_sidecar_input_pickups_total", {"how": "polled"}),
             "woken": ("code2wav_sidecar_input_pickups_total", {"how": "woken"}),
             "steps": ("code2wav_sidecar_batch_size_count", {}),
             "batched": ("code2wav_sidecar_batch_size_sum", {})}


def _server_counters(spawned) -> dict[str, float]:
    """The sidecar's counters that explain a run: IPC chunks deferred for their codes, input pickups, engine steps
    and the chunks they held (their ratio is the mean batch size)."""
    text = spawned.scrape()
    return {key: metric_value(text, name, **labels) for key, (name, labels) in _COUNTERS.items()}


def _drive(address: str, use_ipc: bool, concurrency: int, chunks_per_stream: int, chunk_frames: int,
           num_quantizers: int, codebook_size: int,
           between: Callable[[], list[float]] | None = None) -> tuple[list[float], dict, list[float]]:
    """Round trips of ``concurrency`` streams; with ``between`` (concurrency 1), also what it returns, called
    after every ``_BLOCK`` measured chunks (the in-process reference, interleaved block by block: in blocks, so
    the chunks still follow each other as in a stream, and the sidecar sees their usual spacing)."""
    latencies: list[float] = []
    between_s: list[float] = []
    lock = threading.Lock()
    with SidecarClient(address, timeout_s=120, cuda_ipc=use_ipc) as client:
        codes = synthetic_codes(num_quantizers, chunk_frames, codebook_size, seed=4).cuda()

        def one(index: int) -> None:
            stream = client.open_stream(f"t-{int(use_ipc)}-{concurrency}-{index}")
            mine = []
            # One caller spins on its CUDA sync, as a runner's one thread does. Many callers sleep in theirs:
            # dozens of threads spinning would take the CPUs that the sidecar and the client's I/O thread need.
            done = None if concurrency == 1 else torch.cuda.Event(blocking=True)
            for i in range(chunks_per_stream + 5):
                t0 = time.perf_counter()
                audio = stream.decode(codes)
                assert audio.is_cuda
                if done is None:
                    torch.cuda.current_stream().synchronize()
                else:
                    done.record()
                    done.synchronize()
                if i >= 5:  # warm-up: registration, first replays
                    mine.append(time.perf_counter() - t0)
                del audio
                if between is not None and i >= 5 and (i - 5) % _BLOCK == _BLOCK - 1:
                    between_s.extend(between())
            if between is not None and not between_s:  # fewer chunks than one block
                between_s.extend(between())
            stream.abort()
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = client.ipc_stats
    return latencies, stats, between_s


def _measure_level(level: int, args, spawned, ref: InProcessReference, between, first_ref: dict[int, float],
                   num_quantizers: int, codebook_size: int) -> list[dict]:
    """The inline and the ipc row of one concurrency level, each against its in-process reference. Times are
    rounded to 1 us (ms with 3 decimals; the overhead in whole us): the wire's cost is measured in us."""
    batch_cap = args.transport_batch
    per_stream = max(10, args.transport_chunks // level)
    batch = 1 if level == 1 else batch_cap
    steps = level / min(level, batch_cap)
    interleave = level == 1  # reference blocks between chunk blocks: both see the same GPU state
    before_ms = 0.0 if interleave else ref.p50_ms(batch, args.baseline_iters)
    pair = []
    for transport in ("inline", "ipc"):
        before = _server_counters(spawned)
        times, stats, ref_s = _drive(spawned.address, transport == "ipc", level, per_stream,
                                     args.chunk_frames, num_quantizers, codebook_size, between if interleave else None)
        after = _server_counters(spawned)
        pair.append((transport, times, stats, {key: after[key] - before[key] for key in after}, ref_s))
    after_ms = 0.0 if interleave else ref.p50_ms(batch, args.baseline_iters)
    rows = []
    for transport, times, stats, counters, ref_s in pair:
        if interleave:
            reference, how = _percentiles(ref_s)[0], "interleaved"
        else:
            reference, how = steps * (before_ms + after_ms) / 2, [round(steps * before_ms, 3), round(steps * after_ms, 3)]
        first_ref.setdefault(batch, reference / steps)
        p50, p95 = _percentiles(times)
        rows.append({"transport": transport, "concurrency": level, "chunks": len(times), "p50_ms": round(p50, 3),
                     "p95_ms": round(p95, 3), "in_process_ms": round(reference, 3),
                     "overhead_p50_us": round((p50 - reference) * 1e3), "in_process_measured": how,
                     "ipc_chunks": stats.get("ipc_chunks", 0), "server_counters": counters,
                     "fallbacks": {k2: v for k2, v in stats.items() if k2.startswith("inline_fallback")}})
    return rows


def _print_rows(args, rows: list[dict], first_ref: dict[int, float]) -> None:
    print(f"\nin-process graph step (GPU codes -> GPU audio), {args.chunk_frames} frames, first measurement: "
          + ", ".join(f"b{b} {ms:.3f} ms" for b, ms in sorted(first_ref.items()))
          + f"; each row's inproc_ms: at concurrency 1 the p50 of reference steps run in blocks of {_BLOCK} between "
          f"blocks of its chunks, "
          "else the mean of measurements right before and after its inline/ipc pair")
    print(f"{'transport':>9} {'conc':>5} {'chunks':>7} {'p50_ms':>8} {'p95_ms':>8} {'inproc_ms':>9} "
          f"{'overhead_us':>11} {'ipc_chunks':>10} {'deferred':>8} {'polled':>7} {'woken':>6} {'steps':>6} {'batch':>5}")
    for r in rows:
        c = r["server_counters"]
        print(f"{r['transport']:>9} {r['concurrency']:>5} {r['chunks']:>7} {r['p50_ms']:>8.3f} {r['p95_ms']:>8.3f} "
              f"{r['in_process_ms']:>9.3f} {r['overhead_p50_us']:>11.0f} {r['ipc_chunks']:>10} {c['deferred']:>8.0f} "
              f"{c['polled']:>7.0f} {c['woken']:>6.0f} {c['steps']:>6.0f} {c['batched'] / max(c['steps'], 1):>5.1f} "
              f"{r['fallbacks'] or ''}")


def run(args) -> int:
    from code2wav.sidecar.models import configure_cuda, load_model, resolve_device

    device = resolve_device(args.device)
    if device.type != "cuda":
        print("bench --transport compares CUDA IPC with inline bytes: it needs a CUDA device")
        return 2
    configure_cuda()
    levels = [int(x) for x in args.concurrency.split(",") if x]
    model = load_model(args.model, device, args.dtype)
    q, k = model.num_quantizers, model.codebook_size
    batch_cap = args.transport_batch
    ref = InProcessReference(model, args.chunk_frames, tuple(sorted({1, batch_cap})))
    workdir = Path(tempfile.mkdtemp(prefix="code2wav-transport-"))
    config = workdir / "sidecar.yaml"
    config.write_text(f"scheduler:\n  batch_window_us: 0\n  max_batch_size: {batch_cap}\n")
    spawned = spawn_sidecar("--model", args.model, "--device", str(device), "--dtype", args.dtype,
                            "--config", str(config), *args.serve_arg, workdir=workdir)
    print(spawned.ready_line, flush=True)
    print(f"sidecar log: {spawned.log_path}", flush=True)
    rows: list[dict] = []
    first_ref: dict[int, float] = {}

    def between() -> list[float]:
        return [ref.step_s(1) for _ in range(_BLOCK)]

    progress = Progress()
    steps = [Step(f"concurrency {level}: inline then ipc") for level in levels]
    elapsed: list[float] = []
    interrupted = None
    progress.say(f"transport: {len(steps)} levels, {args.transport_chunks} chunks per level and transport; "
                 f"{progress.left_text(steps, 0, elapsed)}")
    try:
        for i, level in enumerate(levels):
            progress.say(f"transport {i + 1}/{len(levels)}: {steps[i].label} ...")
            t0 = progress.clock()
            rows += _measure_level(level, args, spawned, ref, between, first_ref, q, k)
            elapsed.append(progress.clock() - t0)
            progress.say(f"transport {i + 1}/{len(levels)} done in {elapsed[-1]:.0f} s: "
                         + ", ".join(f"{r['transport']} p50 {r['p50_ms']:.3f} ms" for r in rows[-2:])
                         + f"; {progress.left_text(steps, i + 1, elapsed)}")
    except KeyboardInterrupt:
        interrupted = steps[len(elapsed)].label
        progress.say(f"interrupted during {interrupted}; keeping what finished")
    finally:
        if spawned.stop(log_copy=args.sidecar_log) in (0, -15, -9):
            shutil.rmtree(workdir, ignore_errors=True)  # its config and socket folder (the log: --sidecar-log)
    _print_rows(args, rows, first_ref)
    if args.json_path:
        report = {"in_process_ms": {b: round(ms, 3) for b, ms in first_ref.items()}, "rows": rows,
                  "settings": {"dtype": args.dtype, "model": args.model, "chunk_frames": args.chunk_frames,
                               "batch_cap": batch_cap}}
        if interrupted is not None:
            report["interrupted"] = interrupted
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_path}" + (" (interrupted: partial)" if interrupted else ""))
    if interrupted is not None:
        return 130
    return 0
