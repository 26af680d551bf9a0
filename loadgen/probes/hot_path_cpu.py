"""The Python a chunk costs outside the model, hot, on one thread, no sockets and no GPU: the client's encode of a
``decode`` message (one inline chunk), the sidecar parsing, checking and queueing it, taking the batch, completing
the job (with audio made up front: no decode), encoding the reply, and the client parsing it; then a graph step's
host staging (``StreamRoutine.copy_in``) at batch 1, 16 and 64. Tiny golden model on the CPU. A regression check for the per-chunk Python; at concurrency 1 on the GPU machine the same steps take
several times longer cold (loadgen/probes/round_trip.py has the real way in and out).

    python loadgen/probes/hot_path_cpu.py          (PROF=1: cProfile of the timed loop, by own time)
"""
import cProfile, io, os, pstats, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import torch
from prometheus_client import CollectorRegistry

from code2wav import proto
from code2wav.sidecar import bootstrap
from code2wav.sidecar.config import load_config
from code2wav.sidecar.metrics import Metrics
from code2wav.sidecar.scheduler import Scheduler

cfg = load_config(None, {"model": str(ROOT / "tests/data/golden/tiny_a"), "device": "cpu"})
metrics = Metrics(CollectorRegistry())
scheduler = Scheduler(cfg.scheduler.max_batch_size, 0.0, cfg.scheduler.max_pending_chunks)
parts = bootstrap.build_engine_side(cfg, torch.device("cpu"), scheduler, metrics)
sessions = bootstrap.build_sessions(cfg, parts, scheduler, metrics)
identity = b"client-1"
sessions.on_message(identity, proto.encode(proto.Hello(1, proto.PROTOCOL_VERSION, "probe", {})))
sessions.on_message(identity, proto.encode(proto.OpenStream(2, "s", None, "exact", 0, {})))
assert [type(o.message).__name__ for o in sessions.out.take()] == ["Welcome", "Opened"]
model = parts.model
num_quantizers, num_frames = model.num_quantizers, 1
codes = torch.randint(0, model.codebook_size, (num_quantizers, num_frames)).numpy()  # [Q, n] int64
audio = torch.zeros(num_frames * model.samples_per_frame)  # [n * U] the decode's output, made once


def one_chunk(seq: int) -> tuple[float, ...]:
    t0 = time.perf_counter()
    desc = proto.TensorDesc("int64", (num_quantizers, num_frames), proto.InlineLoc(1))
    frames = proto.encode(proto.Decode(10 + seq, (proto.Chunk("s", seq, desc, False, 0),)),
                          [memoryview(codes).cast("B")])
    frames = [bytes(f) for f in frames]  # as received
    t1 = time.perf_counter()
    sessions.on_message(identity, frames)
    t2 = time.perf_counter()
    batch = scheduler.take_batch()
    sessions.build_items(batch)
    for job in batch:
        sessions.complete_job(job, audio)
    sessions.release_in_flight(batch)
    t3 = time.perf_counter()
    wire = [proto.encode(o.message, o.buffers) for o in sessions.out.take()]
    t4 = time.perf_counter()
    reply = proto.decode_server_message(wire[0])
    t5 = time.perf_counter()
    assert reply.results[0].error is None, reply
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4


num_chunks = int(os.environ.get("N", 5000))
for seq in range(200):  # warm
    one_chunk(seq)
profile = cProfile.Profile() if os.environ.get("PROF") == "1" else None
if profile:
    profile.enable()
rows = [one_chunk(200 + i) for i in range(num_chunks)]
if profile:
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
names = ("client: encode the decode message", "sidecar: parse, check, queue", "sidecar: take, complete, release",
         "sidecar: encode the reply", "client: parse the reply")
for k, name in enumerate(names):
    print(f"{name:>36}: p50 {statistics.median(r[k] for r in rows) * 1e6:6.1f} us")
print(f"{'per chunk':>36}: p50 {statistics.median(sum(r) for r in rows) * 1e6:6.1f} us ({num_chunks} chunks)")

# a graph step's host staging (StreamRoutine.copy_in; no graph on the CPU, the copy in itself is the same code)
from code2wav.sidecar.graphs.routine import StreamRoutine  # noqa: E402
from code2wav.sidecar.work import DecodeItem  # noqa: E402

routine = StreamRoutine(model, parts.arena, 64, 25)
for batch, frames in ((1, 1), (1, 25), (16, 25), (64, 25)):
    items = [DecodeItem(torch.randint(0, model.codebook_size, (num_quantizers, frames)), slot % parts.arena.num_slots,
                        0) for slot in range(batch)]
    times = []
    for i in range(550):
        t0 = time.perf_counter()
        routine.copy_in(batch, frames, items)
        times.append(time.perf_counter() - t0)
    print(f"{f'copy_in, batch {batch} x {frames} frames':>36}: p50 {statistics.median(times[50:]) * 1e6:6.1f} us")
