"""``code2wav-sidecar bench --stages``: where the microseconds of one chunk go at concurrency 1, stage by stage.

Spawns a sidecar with ``trace_chunks`` on (``sidecar/chunk_trace.py``), runs one stream of ``--stages-chunks`` chunks
of ``--chunk-frames`` frames (after ``--stages-warmup`` untimed ones) through a client with a ``CallTrace``
(``client/call_trace.py``), each chunk sent once the previous one's audio is back (concurrency 1), with inputs on the
host (inline bytes both ways) and, on CUDA, on the GPU too (CUDA IPC both ways: armed chunks, ``device``, codes
events, ``device-events``, and codes events with early audio, ``device-early``: each chunk answered at its step's
launch, so its device time shows in ``audio_ready``); then fetches the sidecar's stamps
from ``/debug/chunk-stages``, joins them with the client's by ``(stream_id, seq)`` and prints the table of
``stage_table.py``: per stage p50 / p90 / mean in microseconds and share of the round trip. On CUDA a last table
(``handoff.py``) times the hand-off on the GPU's clock, armed against codes events, with codes made while the
message is already on its way. ``--json`` writes them.

The stamps of both processes are ``time.monotonic_ns()``: CLOCK_MONOTONIC is one clock for every process of a Linux
host, so the sidecar and the client must share the host (a spawned sidecar does). Stamping costs a few clock reads
per chunk (well under a microsecond each); with the trace off the sidecar and the client check one ``is None`` per
stamping place.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from code2wav.client import SidecarClient
from code2wav.client.call_trace import CallTrace
from code2wav.sidecar.chunk_trace import CHUNK_STAGES_PATH

from .server_metrics import metric_value
from .handoff import format_handoff, measure_handoff
from .inputs import InputContract, synthetic_inputs
from .loop_table import LoopProfileWindow, format_loop_profile, per_chunk
from .phases import Progress
from .spawn import SpawnedSidecar, spawn_sidecar
from .stage_table import format_table, join, legend, summarize

EARLY_COUNTER = "code2wav_sidecar_chunks_answered_early_total"
"""The sidecar's count of chunks answered at their step's launch (early audio): each table records its own."""


def run_stream(address: str, inputs_on: str, device: torch.device | None, num_chunks: int, warmup: int,
               chunk_frames: int, armed: bool = True, window: LoopProfileWindow | None = None,
               early_audio: bool = False) -> tuple[list[dict], dict, dict]:
    """One stream of ``warmup + num_chunks`` chunks at concurrency 1; returns the caller's stamps of the timed
    chunks (stream_id, seq, called_ns, returned_ns, ready_ns), the client's (``CallTrace.chunks``) and the
    client's CUDA IPC counts. ``window``: the sidecar's loop profile, started before the first timed chunk and
    stopped after the last."""
    trace = CallTrace(capacity=warmup + num_chunks)
    calls = []
    with SidecarClient(address, timeout_s=120, trace=trace, cuda_ipc=device is not None, ipc_armed=armed) as client:
        inputs = synthetic_inputs(InputContract.of(client.models[0]), (warmup + num_chunks) * chunk_frames, seed=0)
        if device is not None:  # [Q|D, T] on the GPU, where a talker leaves them
            inputs = inputs.to(device)
            torch.cuda.synchronize(device)
        stream = client.open_stream(f"stages-{inputs_on}-{time.monotonic_ns()}", early_audio=early_audio)
        for i in range(warmup + num_chunks):
            if window is not None and i == warmup:
                window.start()
            chunk = inputs[:, i * chunk_frames:(i + 1) * chunk_frames]  # [Q|D, chunk_frames]
            seq = stream.next_seq
            called_ns = time.monotonic_ns()
            audio = stream.decode(chunk, final=i == warmup + num_chunks - 1)
            returned_ns = time.monotonic_ns()
            if audio.is_cuda:  # CUDA IPC audio is ready in the order of the caller's stream: one thread spins there
                torch.cuda.current_stream(audio.device).synchronize()
            ready_ns = time.monotonic_ns() if audio.is_cuda else returned_ns
            if i >= warmup:
                calls.append({"stream_id": stream.stream_id, "seq": seq, "called_ns": called_ns,
                              "returned_ns": returned_ns, "ready_ns": ready_ns})
            del audio
        if window is not None:
            window.stop()
        ipc = client.ipc_stats
    return calls, trace.chunks(), ipc


def measure(spawned: SpawnedSidecar, inputs_on: str, device: torch.device, num_chunks: int, warmup: int,
            chunk_frames: int, loop_profile_rows: int = 0) -> dict:
    """The table of one kind of inputs (``host``, ``device``: armed, ``device-events``, ``device-early``: codes
    events and early audio), with its joined chunks' count and IPC counts; with ``loop_profile_rows``, the sidecar's
    loop thread per chunk (``loop_table``)."""
    window = LoopProfileWindow(spawned) if loop_profile_rows else None
    early_before = metric_value(spawned.scrape(), EARLY_COUNTER)
    calls, client_chunks, ipc = run_stream(spawned.address, inputs_on, None if inputs_on == "host" else device,
                                           num_chunks, warmup, chunk_frames, armed=inputs_on == "device",
                                           window=window, early_audio=inputs_on == "device-early")
    document = json.loads(spawned.get(CHUNK_STAGES_PATH))
    joined, missing = join(calls, client_chunks, document["chunks"])
    if not joined:
        raise RuntimeError(f"no chunk of the {inputs_on} run was stamped by both the client and the sidecar "
                           f"({missing} calls unmatched; the sidecar recorded {document['recorded']})")
    table = {"inputs_on": inputs_on, "chunk_frames": chunk_frames, "unmatched": missing,
             "ipc_chunks": ipc.get("ipc_chunks", 0),
             "answered_early": int(metric_value(spawned.scrape(), EARLY_COUNTER) - early_before), **summarize(joined)}
    if window is not None and window.document is not None:
        table["loop_profile"] = per_chunk(window.document, num_chunks, loop_profile_rows)
    return table


def run(args) -> int:
    """``bench --stages``: spawn, measure each kind of inputs, print the tables, write ``--json``."""
    from code2wav.sidecar.models import configure_cuda, resolve_device

    if args.address is not None:
        print("error: --stages spawns its own sidecar (with trace_chunks on); it does not take --address",
              file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    kinds = ["host", "device", "device-events", "device-early"] if device.type == "cuda" else ["host"]
    if device.type == "cuda":
        configure_cuda()
    num_chunks, warmup = args.stages_chunks, args.stages_warmup
    workdir = Path(tempfile.mkdtemp(prefix="code2wav-stages-"))
    config = workdir / "sidecar.yaml"
    config.write_text(f"trace_chunks: {len(kinds) * (num_chunks + warmup)}\n"
                      + ("profile_loop: true\n" if args.stages_loop_profile else ""))
    progress = Progress()
    progress.say(f"stages: spawning a sidecar with trace_chunks on ({args.model}, {device}, {args.dtype})")
    spawned = spawn_sidecar("--model", args.model, "--device", str(device), "--dtype", args.dtype,
                            "--config", str(config), *args.serve_arg, workdir=workdir,
                            timeout_s=300.0 if device.type == "cuda" else 120.0)  # (a bare GPU host times conv forms)
    print(spawned.ready_line, flush=True)
    tables, handoffs, interrupted = [], [], None
    try:
        for kind in kinds:
            progress.say(f"stages: one stream, inputs on the {kind}, {warmup} + {num_chunks} chunks of "
                         f"{args.chunk_frames} frames ...")
            tables.append(measure(spawned, kind, device, num_chunks, warmup, args.chunk_frames,
                                  args.stages_loop_profile))
            rt = tables[-1]["round_trip"]
            progress.say(f"stages: {kind} done: round trip p50 {rt['p50_us']:.1f} us, p90 {rt['p90_us']:.1f} us")
        for armed in (True, False) if device.type == "cuda" else ():
            progress.say(f"stages: the hand-off on the GPU's clock, {'armed' if armed else 'codes events'}, codes made "
                         f"after {args.stages_busy_ms:g} ms of GPU work ...")
            handoffs.append(measure_handoff(spawned.address, device, armed, num_chunks, warmup, args.chunk_frames,
                                            args.stages_busy_ms))
    except KeyboardInterrupt:
        interrupted = (f"inputs on the {kinds[len(tables)]}" if len(tables) < len(kinds)
                       else "the hand-off on the GPU's clock")
        progress.say(f"interrupted during {interrupted}; keeping what finished")
    finally:
        if spawned.stop(log_copy=args.sidecar_log) in (0, -15, -9):
            shutil.rmtree(workdir, ignore_errors=True)  # its config, socket and log (the log: --sidecar-log)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    for table in tables:
        early = f"; {table['answered_early']} answered at launch (early audio)" if table["answered_early"] else ""
        print("\n" + format_table(f"one chunk at concurrency 1, inputs on the {table['inputs_on']} "
                                  f"({gpu or device}, {args.dtype}, {args.chunk_frames} frames{early})", table))
        if "loop_profile" in table:
            print("\n" + format_loop_profile(f"the sidecar's loop thread per chunk, inputs on the "
                                              f"{table['inputs_on']} (profiled: not the latency above)",
                                              table["loop_profile"]))
    if tables:
        print("\n" + legend())
    if handoffs:
        print("\n" + format_handoff(handoffs, f"the hand-off on the GPU's clock: codes made -> audio ready on the "
                                              f"caller's stream ({gpu}, {args.chunk_frames} frames, codes made after "
                                              f"{args.stages_busy_ms:g} ms of GPU work)"))
    if args.json_path:
        report = {"environment": {"device": str(device), "gpu": gpu, "dtype": args.dtype, "model": args.model,
                                  "torch": torch.__version__},
                  "settings": {"chunk_frames": args.chunk_frames, "stages_chunks": num_chunks,
                               "stages_warmup": warmup, "stages_busy_ms": args.stages_busy_ms,
                               "stages_loop_profile": args.stages_loop_profile,
                               "serve_arg": list(args.serve_arg)},
                  "stages": tables, "handoff": handoffs}
        if interrupted is not None:
            report["interrupted"] = interrupted
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_path}" + (" (interrupted: partial)" if interrupted else ""))
    return 130 if interrupted is not None else 0
