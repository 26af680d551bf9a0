"""``code2wav-sidecar bench``: the instrument every performance claim of the project comes from.

Spawns a sidecar (or connects to ``--address``), drives ``--concurrency`` levels of synthetic streams shaped
like vLLM-Omni traffic, and measures in-process baselines on the same device and model in the same run, so
every sidecar figure is also a ratio against them. Prints a table; ``--json`` and ``--plot`` write files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
from dataclasses import asdict

import torch

from code2wav.client import SidecarClient

from code2wav.sidecar.cli import DefaultsHelpFormatter

from .drive import run_level, summarize
from .options import add_server_key_option
from .spawn import spawn_sidecar
from .stock_bench import add_stock_args, run_stock_phase


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="code2wav-sidecar bench", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--address", help="benchmark a running sidecar instead of spawning one")
    add_server_key_option(p)
    p.add_argument("--metrics-url", help="with --address: its /metrics URL (batch size, graph hit rate)")
    p.add_argument("--model", default="default", help="folder or 'default' (spawned sidecar and baselines)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--concurrency", default="1,8,64", help="comma-separated stream counts")
    p.add_argument("--frames", type=int, default=101, help="frames per stream (first chunk, then chunks)")
    p.add_argument("--first-chunk-frames", type=int, default=1)
    p.add_argument("--chunk-frames", type=int, default=25)
    p.add_argument("--mode", default="exact", choices=["exact", "window"])
    p.add_argument("--arrival", default="closed", choices=["closed", "realtime"],
                   help="closed: next chunk as soon as the reply is in; realtime: a frame every 80 ms per stream")
    p.add_argument("--clients", type=int, default=4, help="client connections the streams are spread over")
    p.add_argument("--baseline-iters", type=int, default=20)
    p.add_argument("--baseline-batch", default="1", help="comma-separated batch sizes for exact-eager baselines")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--profile-batch", type=int, default=0,
                   help="also print torch.profiler's top operators for one eager exact step at this batch size")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for the spawned sidecar")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    p.add_argument("--replot", metavar="JSON", help="only draw --plot (and print the table) from an earlier --json")
    p.add_argument("--sidecar-log", help="copy the spawned sidecar's log (graph capture lines) here")
    p.add_argument("--transport", action="store_true",
                   help="instead: per-chunk round trip of inline bytes vs CUDA IPC against the in-process decode")
    p.add_argument("--transport-batch", type=int, default=16, help="--transport: the sidecar's max batch size")
    p.add_argument("--transport-chunks", type=int, default=1000, help="--transport: chunks per level and transport")
    add_stock_args(p)
    return p


def environment(device: torch.device, dtype: str, model: str) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": str(device), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
            "dtype": dtype, "model": model, "cpu_threads": torch.get_num_threads()}


def print_table(baselines: list[dict], rows: list[dict], ref: dict | None) -> None:
    if baselines:
        print("\nin-process baselines (same device, model, dtype)")
        print(f"{'baseline':<18} {'batch':>5} {'frames':>6} {'p50_ms':>8} {'p95_ms':>8} {'audio_s/s':>10}")
        for b in baselines:
            print(f"{b['name']:<18} {b['batch']:>5} {b['new_frames']:>6} {b['latency_ms_p50']:>8.2f} "
                  f"{b['latency_ms_p95']:>8.2f} {b['audio_s_per_s']:>10.1f}")
    print("\nthrough the sidecar" + (f" (x = ratio to {ref['name']})" if ref else ""))
    head = (f"{'conc':>5} {'mode':>6} {'arrival':>8} {'p50_ms':>8} {'p95_ms':>8} {'p99_ms':>8} {'first_p50':>9} "
            f"{'audio_s/s':>10} {'x_thru':>7} {'x_p50':>6} {'batch':>6} {'graph':>6} {'err':>4}")
    print(head)

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]) if "." in spec else 1)

    for r in rows:
        x_thru = r["audio_s_per_s"] / ref["audio_s_per_s"] if ref else None
        x_p50 = (r["chunk_latency_ms_p50"] / ref["latency_ms_p50"]) if ref and r["chunk_latency_ms_p50"] else None
        print(f"{r['concurrency']:>5} {r['mode']:>6} {r['arrival']:>8} {fmt(r['chunk_latency_ms_p50'], '8.2f')} "
              f"{fmt(r['chunk_latency_ms_p95'], '8.2f')} {fmt(r['chunk_latency_ms_p99'], '8.2f')} "
              f"{fmt(r['first_chunk_latency_ms_p50'], '9.2f')} {r['audio_s_per_s']:>10.1f} {fmt(x_thru, '7.2f')} "
              f"{fmt(x_p50, '6.2f')} {fmt(r['mean_batch_size'], '6.1f')} {fmt(r['graph_hit_rate'], '6.2f')} "
              f"{r['errors']:>4}")
    if any(r.get("server_mean_ms") for r in rows):
        print("\nserver-side means from /metrics (ms): arrival->reply, engine step, wait for batch")
        for r in rows:
            sm = r.get("server_mean_ms") or {}
            print(f"{r['concurrency']:>5}  reply {sm.get('server_chunk_latency', float('nan')):8.2f}  "
                  f"step {sm.get('engine_step', float('nan')):8.2f}  wait {sm.get('batch_wait', float('nan')):8.2f}  "
                  f"client-seen mean {r['mean_chunk_latency_ms'] or float('nan'):8.2f}")


def plot(path: str, baselines: list[dict], rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("chunk_latency_ms_p50", "p50"), ("chunk_latency_ms_p99", "p99")):
        ax1.plot(conc, [r[key] for r in rows], marker="o", label=f"sidecar {label}")
    ax2.plot(conc, [r["audio_s_per_s"] for r in rows], marker="o", label="sidecar")
    styles = ("--", ":", "-.")
    for i, b in enumerate(baselines):
        style = {"linestyle": styles[i % len(styles)], "linewidth": 1.2, "color": f"C{i + 2}"}
        ax1.axhline(b["latency_ms_p50"], label=f"{b['name']} p50 (in-process)", **style)
        ax2.axhline(b["audio_s_per_s"], label=f"{b['name']} (in-process)", **style)
    ax1.set_yscale("log")
    for ax, ylabel in ((ax1, "chunk latency (ms)"), (ax2, "audio seconds decoded per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(args: argparse.Namespace) -> int:
    with open(args.replot) as f:
        report = json.load(f)
    baselines, rows, env = report["baselines"], report["results"], report["environment"]
    print_table(baselines, rows, next((b for b in baselines if b["name"] == "window-eager-b1"), None))
    if args.plot_path:
        title = (f"code2wav-sidecar bench: {env['gpu'] or env['device']}, {env['dtype']}, model {env['model']}, "
                 f"{report['settings']['arrival']}")
        plot(args.plot_path, baselines, rows, title)
        print(f"wrote {args.plot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(args)
    if args.transport:
        from .transport_bench import run as run_transport

        return run_transport(args)
    from code2wav.sidecar.models import configure_cuda, load_model, resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        configure_cuda()  # the server's defaults, so baselines and sidecar run the same math
    levels = [int(x) for x in args.concurrency.split(",") if x]
    baselines: list[dict] = []
    stock: dict = {"skipped": "--no-baselines"}
    if not args.no_baselines:
        from .baselines import run_baselines

        model = load_model(args.model, device, args.dtype)
        batches = tuple(int(x) for x in args.baseline_batch.split(","))
        baselines = [asdict(b) for b in run_baselines(model, new_frames=args.chunk_frames,
                                                      iters=args.baseline_iters, batch_sizes=batches)]
        if args.profile_batch:
            from .baselines import profile_kernels

            print(f"\nprofile: one eager exact step, batch {args.profile_batch} x {args.chunk_frames} frames")
            print(profile_kernels(model, args.profile_batch, args.chunk_frames))
        stock = run_stock_phase(args, model)  # vLLM-Omni 0.30's own Code2Wav, same device/dtype/weights
        baselines += stock.get("rows", [])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    spawned = None
    address, metrics_url = args.address, args.metrics_url
    if address is None:
        serve = ["--model", args.model, "--device", str(device), "--dtype", args.dtype, *args.serve_arg]
        spawned = spawn_sidecar(*serve)
        address, metrics_url = spawned.address, spawned.metrics_url
        print(spawned.banner(), flush=True)
    rows = []
    try:
        clients = [SidecarClient(address, timeout_s=120, curve_server_key=args.server_key)
                   for _ in range(max(1, args.clients))]
        try:
            for level in levels:
                result = asyncio.run(run_level(clients, level, args.mode, args.frames, args.first_chunk_frames,
                                               args.chunk_frames, args.arrival, metrics_url, tag="bench"))
                rows.append(summarize(result))
                print(f"concurrency {level}: {rows[-1]['chunks']} chunks, {rows[-1]['audio_s_per_s']:.1f} audio-s/s, "
                      f"p50 {rows[-1]['chunk_latency_ms_p50']} ms, errors {rows[-1]['errors']}", flush=True)
        finally:
            for c in clients:
                c.close()
    finally:
        if spawned is not None:
            spawned.stop()
            if args.sidecar_log:
                with open(args.sidecar_log, "w") as f:
                    f.write(spawned.log())
    ref = next((b for b in baselines if b["name"] == "window-eager-b1"), None)
    print_table(baselines, rows, ref)
    env = environment(device, args.dtype, args.model)
    report = {"environment": env, "baselines": baselines, "results": rows, "vllm_omni_stock": stock,
              "settings": {k: v for k, v in vars(args).items() if k not in ("json_path", "plot_path")}}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        title = f"code2wav-sidecar bench: {env['gpu'] or env['device']}, {args.dtype}, model {args.model}, {args.arrival}"
        plot(args.plot_path, baselines, rows, title)
        print(f"wrote {args.plot_path}")
    errors = sum(r["errors"] for r in rows)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
