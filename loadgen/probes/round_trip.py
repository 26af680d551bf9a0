"""c=1 IPC round trips against a probed sidecar: joined per-chunk marks, then cProfile of both sides."""
import functools
import _marks  # loadgen/probes/_marks.py (this folder is on sys.path when run as a script)
import cProfile, io as sio, json, os, pstats, signal, statistics, subprocess, sys, time
from pathlib import Path
import torch
from code2wav.client import SidecarClient
import code2wav.client.cuda_ipc.channel as CH
import code2wav.client._io as IO
out_dir = Path(os.environ.get("OUT", "/tmp"))
dtype = os.environ.get("PROBE_DTYPE", "bfloat16")
model = os.environ.get("PROBE_MODEL", "default")  # or voxcpm2-default (then PROBE_FRAMES=4, PROBE_DTYPE=float32)
num_frames = int(os.environ.get("PROBE_FRAMES", "25"))
cfg = Path("/tmp/w0.yaml"); cfg.write_text("scheduler:\n  batch_window_us: 0\n" + os.environ.get("EXTRA_CFG", ""))
cur = {}
wrap = functools.partial(_marks.wrap, marks=cur)
def run(prof: bool, n: int, label: str):
    addr = f"ipc:///tmp/prof-{label}/s.sock"
    out = f"/tmp/prof-{label}.json"
    env = dict(os.environ, PROF="1" if prof else "0")
    pin = ["taskset", "-c", os.environ["SERVER_CPUS"]] if os.environ.get("SERVER_CPUS") else []  # pinned sidecar
    p = subprocess.Popen(pin + [sys.executable, "loadgen/probes/round_trip_server.py", "serve", "--address", addr, "--model", model,
                          "--device", "cuda", "--dtype", dtype, "--config", str(cfg), "--metrics-port", "0",
                          "--probe-out", out], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    while not p.stdout.readline().startswith("code2wav-sidecar ready"): pass
    rows = []
    cp = cProfile.Profile()
    try:
        with SidecarClient(addr, cuda_ipc=True) as c:
            st = c.open_stream("a")
            info = c.models[0]
            if info.input_kind == "codes":
                codes = torch.randint(0, info.codebook_size, (info.channels, num_frames)).cuda()  # [Q, n]
            else:
                codes = torch.randn(info.channels, num_frames).cuda()  # [D, n] latents
            for i in range(n + 50):
                cur.clear()
                if prof and i == 50: cp.enable()
                t0 = time.perf_counter(); a = st.decode(codes); t1 = time.perf_counter()
                if os.environ.get("SPIN") == "1":
                    cs = torch.cuda.current_stream()
                    while not cs.query(): pass
                else:
                    torch.cuda.current_stream().synchronize()
                t2 = time.perf_counter()
                rows.append(dict(cur, t0=t0, ret=t1, synced=t2))
                del a
            if prof: cp.disable()
            stats = c.ipc_stats
    finally:
        p.send_signal(signal.SIGTERM); p.wait()
    srows = json.load(open(out))
    print(f"=== {label} prof={prof} {stats} client rows {len(rows)} server rows {len(srows)}")
    if len(srows) == len(rows):
        if os.environ.get("FINE") == "1":
            fine = ["t0", "wire0", "wire1", "res0", "res1", "lpack0", "packed0", "copy0", "copy1", "rec0", "rec1", "packed1",
                    "lpack1", "enc0", "enc1", "sent0", "zsend0", "zsend1", "sent1"]
            for a, b in zip(fine, fine[1:]):
                vals = [r[b] - r[a] for r in rows[50:] if a in r and b in r]
                if vals: print(f"  fine {a:>8} -> {b:<8} p50 {statistics.median(vals)*1e6:8.1f} us  n={len(vals)}")
        marks = [("c.t0", "c.packed0"), ("c.packed0", "c.packed1"), ("c.packed1", "c.sent0"), ("c.sent0", "c.sent1"),
                 ("c.sent1", "s.wake"), ("c.t0", "s.wake"), ("s.wake", "s.recv"), ("s.recv", "s.parsed"), ("s.parsed", "s.step0"),
                 ("s.step0", "s.loaded"), ("s.loaded", "s.items"), ("s.items", "s.decoded"), ("s.decoded", "s.stored"),
                 ("s.stored", "s.step1"), ("s.recv", "s.msg"), ("s.msg", "s.inputs"), ("s.inputs", "s.queued"),
                 ("s.queued", "s.parsed"), ("s.parsed", "s.query0"), ("s.query0", "s.queried"),
                 ("s.queried", "s.step0"), ("s.step1", "s.sent"), ("c.t0", "s.step1"), ("c.t0", "c.ret"), ("c.ret", "c.synced"), ("c.t0", "c.synced")]
        for a, b in marks:
            vals = []
            for cr, sr in list(zip(rows, srows))[50:]:
                src = {"c": cr, "s": sr}
                if a[2:] in src[a[0]] and b[2:] in src[b[0]]:
                    vals.append(src[b[0]][b[2:]] - src[a[0]][a[2:]])
            if vals: print(f"{a:>10} -> {b:<10} p50 {statistics.median(vals)*1e6:8.1f} us  n={len(vals)}")
    if prof:
        for name, st_ in (("client", pstats.Stats(cp)), ("server", pstats.Stats(out + ".prof"))):
            for key in ("tottime", "cumulative"):
                s = sio.StringIO(); st_.stream = s; st_.sort_stats(key).print_stats(40)
                print(f"--- {name} by {key}\n" + "\n".join(s.getvalue().splitlines()[6:50]))
if os.environ.get("HOSTWAIT") == "1":  # variant: the I/O thread waits for the sidecar's event on the host
    def audio_tensor(self, packed, event_index):
        self._server_events[event_index].synchronize()
        num_samples = packed.audio_out.shape[0]
        lease = CH._Lease(self._audio.pointer + packed.audio_offset, num_samples, "<f4")
        with self._lock:
            self._live_audio += 1
        CH.weakref.finalize(lease, self._on_view_freed, packed.audio_offset)
        return torch.as_tensor(lease, device=self.device)
    CH.IpcChannel.audio_tensor = audio_tensor
wrap(CH.IpcChannel, "pack", "packed0", "packed1")
wrap(IO.Connection, "_send_direct", "sent0", "sent1")
if os.environ.get("FINE") == "1":
    import code2wav.client.stream as STM, code2wav.client.ledger as LG, code2wav.client.sender as CL, code2wav.client.cuda_ipc._cudart as CR, code2wav.client.cuda_ipc.link as LK
    wrap(STM.Stream, "wire_inputs", "wire0", "wire1")
    wrap(LG.StreamLedger, "reserve", "res0", "res1")
    wrap(LK.IpcLink, "pack", "lpack0", "lpack1")
    wrap(CR.Runtime, "copy_async", "copy0", "copy1")
    wrap(torch.cuda.Event, "record", "rec0", "rec1")
    wrap(CL, "encode", "enc0", "enc1")
    wrap(IO.Connection, "_flush", "zsend0", "zsend1")
    wrap(torch.cuda.Stream, "wait_event", "wait0", "wait1")
run(False, int(os.environ.get("N", 600)), "marks")
if os.environ.get("PROF", "1") == "1":
    run(True, 600, "prof")
