"""Why a stream's first CUDA IPC chunk is slower than its later ones: the first chunk of each stream submitted on
(a) a CUDA stream from torch's pool used for the first time (what the bench did: one per stream), (b) one CUDA
stream reused for every stream (as a runner's), (c) the current stream. The modes alternate stream by stream
against one spawned sidecar; each chunk is timed from submit until its audio is ready on that CUDA stream.

    MODEL=voxcpm2-default DTYPE=float32 FRAMES=4 STREAMS=16 python loadgen/probes/first_chunk.py
"""
import os, statistics, sys, time
import torch
sys.path.insert(0, ".")
from code2wav.client import SidecarClient
from code2wav.loadgen.spawn import spawn_sidecar

model = os.environ.get("MODEL", "voxcpm2-default")
dtype = os.environ.get("DTYPE", "float32")
num_frames = int(os.environ.get("FRAMES", "4"))
num_streams = int(os.environ.get("STREAMS", "16"))
chunks_per_stream = int(os.environ.get("CHUNKS", "8"))
spawned = spawn_sidecar("--model", model, "--device", "cuda", "--dtype", dtype, timeout_s=300)
print(spawned.ready_line, flush=True)
times = {mode: {"first": [], "later": []} for mode in ("pool", "reused", "current")}
try:
    with SidecarClient(spawned.address, cuda_ipc=True) as client:
        info = client.models[0]
        if info.input_kind == "codes":
            inputs = torch.randint(0, info.codebook_size, (info.channels, num_frames), device="cuda")  # [Q, n]
        else:
            inputs = torch.randn(info.channels, num_frames, device="cuda")  # [D, n]
        reused = torch.cuda.Stream()
        with torch.cuda.stream(reused):
            torch.zeros(1, device="cuda").add_(1)
        reused.synchronize()
        warm = client.open_stream("warm-up")
        for i in range(20):
            warm.decode(inputs, final=i == 19)
        torch.cuda.synchronize()
        for i in range(num_streams):
            for mode in times:
                cuda_stream = {"pool": lambda: torch.cuda.Stream(), "reused": lambda: reused,
                               "current": torch.cuda.current_stream}[mode]()
                stream = client.open_stream(f"{mode}-{i}")
                for k in range(chunks_per_stream):
                    t0 = time.perf_counter()
                    with torch.cuda.stream(cuda_stream):
                        audio = stream.decode(inputs, final=k == chunks_per_stream - 1)
                    cuda_stream.synchronize()
                    times[mode]["first" if k == 0 else "later"].append((time.perf_counter() - t0) * 1e3)
                    del audio
finally:
    spawned.stop()
print(f"{model} {dtype} {num_frames} frames, {num_streams} streams per mode, p50 (p90) ms")
for mode, got in times.items():
    line = "  ".join(f"{key} {statistics.median(v):.3f} ({statistics.quantiles(v, n=10)[-1]:.3f})"
                     for key, v in got.items())
    print(f"  {mode:>8}: {line}")
