"""Sidecar under probes: per-chunk marks (perf_counter, same clock as the client) and a cProfile of the loop thread."""
import functools
import _marks  # loadgen/probes/_marks.py (this folder is on sys.path when run as a script)
import atexit, cProfile, json, os, sys, time
sys.path.insert(0, ".")
import code2wav.sidecar.server as S
import code2wav.sidecar.sessions as SS
import code2wav.sidecar.stepper as ST
import code2wav.sidecar.engine as E
rows, cur = [], {}
PROF = os.environ.get("PROF") == "1"
prof = cProfile.Profile() if PROF else None
wrap = functools.partial(_marks.wrap, marks=cur)
wrap(S.Server, "_on_readable", "wake")
wrap(SS.Sessions, "on_message", "recv", "parsed")
wrap(ST.Stepper, "engine_step", "step0", "step1")
wrap(ST, "load_codes", None, "loaded")  # the stepper's own imported names (sidecar/ipc/io.py)
wrap(SS.Sessions, "build_items", None, "items")
if os.environ.get("FINE") == "1":  # the parse step split: message decoded, inputs looked up, chunk queued
    import code2wav.proto as P
    import code2wav.sidecar.scheduler as SCH
    wrap(P, "decode_client_message", None, "msg")
    wrap(SS, "read_chunk_inputs", None, "inputs")
    wrap(SCH.Scheduler, "submit", None, "queued")
    wrap(ST, "incomplete_codes_events", "query0", "queried")  # in Stepper.step, before engine_step (step0)
wrap(E.Engine, "decode", None, "decoded")
wrap(ST, "store_audio", None, "stored")
orig_flush = S.Server.flush
def flush(self):
    n = len(self.sessions.out.messages); orig_flush(self)
    if n and "step1" in cur:
        cur["sent"] = time.perf_counter(); rows.append(dict(cur)); cur.clear()
S.Server.flush = flush
orig_serve = S.Server.serve
async def serve(self):
    if prof: prof.enable()
    try: await orig_serve(self)
    finally:
        if prof: prof.disable(); prof.dump_stats(OUT_PATH + ".prof")
S.Server.serve = serve
def dump():
    with open(OUT_PATH, "w") as f: json.dump(rows, f)
atexit.register(dump)
from code2wav.sidecar.cli import main
OUT_PATH = sys.argv[sys.argv.index("--probe-out") + 1]
sys.exit(main(sys.argv[1:sys.argv.index("--probe-out")]))
