"""pack() step by step after a 4 ms CUDA sync (as in the bench loop), vs hot."""
import time, statistics, torch
from code2wav.client.cuda_ipc.channel import IpcChannel, TensorDesc, CudaIpcLoc, PackedChunk
dev = torch.device("cuda", 0)
ch = IpcChannel(dev, 4 << 20, 64 << 20)
ch.codes_region, ch.audio_region = 1, 2
codes = torch.randint(0, 2048, (16, 25), device=dev)
P = time.perf_counter
def steps():
    m = [P()]
    with ch._lock:
        co = ch._codes.slots.alloc(codes.nbytes); ao = ch._audio.slots.alloc(48000 * 4); ei = ch._event_pool.alloc(1)
    m.append(P())
    caller = torch.cuda.current_stream(0); m.append(P())
    raw = caller.cuda_stream; m.append(P())
    ch._rt.copy_async(ch._codes.pointer + co, codes.data_ptr(), codes.nbytes, raw); m.append(P())
    ch._events[ei].record(caller); m.append(P())
    cd = TensorDesc("int64", tuple(codes.shape), CudaIpcLoc(1, co, codes.nbytes))
    ad = TensorDesc("float32", (48000,), CudaIpcLoc(2, ao, 48000 * 4))
    pk = PackedChunk(ch, cd, ei, ad, co, ao, caller); m.append(P())
    ch.release(pk, audio_used=False); m.append(P())
    return [b - a for a, b in zip(m, m[1:])]
names = ["lock+allocs", "current_stream", ".cuda_stream", "ctypes copy", "event.record", "descs", "release"]
def pre_sync():
    torch.cuda._sleep(4_000_000); torch.cuda.synchronize()
def pre_sleep(): time.sleep(0.004)
for label, pre in (("hot", lambda: None), ("after 4ms cuda sync", pre_sync), ("after sleep 4ms", pre_sleep)):
    rows = []
    for i in range(320):
        pre(); r = steps()
        if i >= 20: rows.append(r)
    cols = list(zip(*rows))
    print(f"{label:22s} " + "  ".join(f"{n} {statistics.median(c)*1e6:6.1f}" for n, c in zip(names, cols))
          + f"  | total {statistics.median([sum(r) for r in rows])*1e6:6.1f} us", flush=True)
