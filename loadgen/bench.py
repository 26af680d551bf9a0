"""``code2wav-sidecar bench``: the instrument every performance claim of the project comes from.

Spawns a sidecar (or connects to ``--address``), drives ``--concurrency`` levels of synthetic streams shaped
like vLLM-Omni traffic, and measures in-process baselines on the same device and model in the same run, so
every sidecar figure is also a ratio against them. Progress per phase goes to stderr, a table to stdout at the end;
``--json`` and ``--plot`` write files (Ctrl-C keeps what finished). On the CPU the defaults are a short run
(``CPU_DEFAULTS``: under a minute with the default model on 2 cores); on a GPU the full levels.
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from .drive import MIN_STREAMS
from .phases import BaselinesPhase, Phase, Progress, SidecarPhase, run_phases
from .report import BenchReport, PlotUnavailable, check_plot_available, load, plot, print_table

from code2wav.sidecar.cli_checks import (DEVICE_HELP, OneLineParser, device_arg, float_above,
                                         input_file, int_at_least, int_list, output_file)
from code2wav.sidecar.cli_help import DTYPE_CHOICES, DefaultsHelpFormatter, command_epilog

from .options import add_server_key_option
from .scenarios import expand, help_text, split_scenario
from .stock_bench import add_stock_args
from .voxcpm2_upstream import add_upstream_args

EXIT_INTERRUPTED = 130
EXIT_USAGE = 2
DESCRIPTION = ("Measure a sidecar (spawned, or --address) at --concurrency levels of synthetic streams shaped like "
               "vLLM-Omni traffic, beside in-process baselines on the same device and model, and print a table of "
               "latency and throughput. Progress per phase goes to stderr. On the CPU the defaults are a short run "
               "(under a minute with the default model); --scenario NAME runs a named flag set (listed below).")
EXAMPLES = ("code2wav-sidecar bench --device cpu --json bench.json",
            "code2wav-sidecar bench --scenario sidecar --json bench.json --plot bench.png")
# flag -> (its default on a GPU, on the CPU): a CPU run of the defaults stays under a minute
DEVICE_DEFAULTS = {"concurrency": ("1,8,64", "1,4"), "frames": (101, 26), "min_streams": (MIN_STREAMS, 4),
                   "baseline_iters": (20, 2), "baseline_warmup": (3, 1)}


def pool_address_arg(text: str) -> str:
    """argparse type: one sidecar's address, several comma-separated, or ``dns://NAME:PORT`` (a pool)."""
    from code2wav.client.discovery import parse_pool_address
    from code2wav.client.errors import InvalidArgument

    if text == "default":
        return text
    try:
        parse_pool_address(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def url_arg(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r}: give an http:// URL, e.g. http://127.0.0.1:9464/metrics")
    return text


def _default_text(dest: str) -> str:
    gpu, cpu = DEVICE_DEFAULTS[dest]
    return f"default: {gpu} on a GPU, {cpu} on the CPU"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="code2wav-sidecar bench", description=DESCRIPTION,
                      epilog=command_epilog(*EXAMPLES) + "\n\n" + help_text(), formatter_class=DefaultsHelpFormatter)
    p.add_argument("--scenario", metavar="NAME[,NAME]",
                   help="run these named flag sets in turn (listed below); other flags given here override theirs")
    p.add_argument("--address", type=pool_address_arg, help="benchmark a running sidecar instead of spawning one; "
                   "several (comma-separated, or dns://NAME:PORT): a pool, with per-sidecar figures")
    add_server_key_option(p)
    p.add_argument("--metrics-url", type=url_arg, help="with --address: its /metrics URL (batch size, graph hit "
                   "rate)")
    p.add_argument("--model", default="default", help="a model folder, or 'default' / 'voxcpm2-default' (random "
                   "weights), for the spawned sidecar and the baselines")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--concurrency", type=int_list(1), help=f"comma-separated stream counts ({_default_text('concurrency')})")
    p.add_argument("--frames", type=int_at_least(1), help=f"frames per stream (first chunk, then chunks; "
                   f"{_default_text('frames')})")
    p.add_argument("--first-chunk-frames", type=int_at_least(0), default=1, help="frames in each stream's first "
                   "chunk (0: no separate first chunk)")
    p.add_argument("--chunk-frames", type=int_at_least(1), default=25, help="frames in each later chunk")
    p.add_argument("--min-streams", type=int_at_least(1), help="closed loop: streams each level runs at least, in "
                   f"turn per slot (first-chunk samples; {_default_text('min_streams')})")
    p.add_argument("--mode", default="exact", choices=["exact", "window"])
    p.add_argument("--arrival", default="closed", choices=["closed", "realtime"],
                   help="closed: next chunk as soon as the reply is in; realtime: a frame every 80 ms per stream")
    p.add_argument("--clients", type=int_at_least(1), default=4, help="client connections the streams are spread over "
                   "(per driving process with --drivers)")
    p.add_argument("--drivers", type=int_at_least(1), default=1,
                   help="processes that drive each level's streams (their shares, started together; one sidecar "
                        "only): one bench process saturates its CPU at thousands of real-time streams "
                        "(loadgen_cpu_s_per_s in each row)")
    p.add_argument("--inputs-on", default="host", choices=["host", "device"],
                   help="where each stream's codes/latents are: host (sent inline as bytes, audio back as bytes) or "
                        "device (CUDA: where a talker leaves them; sent by CUDA IPC, audio back in GPU memory)")
    p.add_argument("--early-audio", action="store_true",
                   help="with --inputs-on device: open the streams with early audio (each CUDA IPC chunk answered "
                        "at its step's launch; proto/README.md section 5)")
    p.add_argument("--baseline-iters", type=int_at_least(1), help="timed iterations per in-process baseline "
                   f"({_default_text('baseline_iters')})")
    p.add_argument("--baseline-warmup", type=int_at_least(0), help="untimed calls before each baseline's timed ones "
                   f"({_default_text('baseline_warmup')})")
    p.add_argument("--baseline-batch", type=int_list(1), default="1", help="comma-separated batch sizes for "
                   "exact-eager baselines")
    p.add_argument("--baseline-frames", type=int_list(1, allow_empty=True), default="",
                   help="comma-separated chunk sizes (frames) of the exact baselines (default: --chunk-frames); "
                        "rows at other sizes than --chunk-frames are named -tN")
    p.add_argument("--peak-tflops", type=float_above(0), default=None,
                   help="the device's peak TFLOP/s for this dtype, for the compute-ceiling fraction (default: "
                        "known for H100 and H200)")
    p.add_argument("--no-baselines", action="store_true", help="skip the in-process baselines")
    p.add_argument("--no-sidecar", action="store_true", help="only the in-process baselines (no sidecar spawned)")
    p.add_argument("--profile-batch", type=int_at_least(0), default=0,
                   help="also print torch.profiler's top operators for one eager exact step at this batch size")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for the spawned sidecar")
    p.add_argument("--json", dest="json_path", type=output_file(), help="write the report here (also when "
                   "interrupted)")
    p.add_argument("--plot", dest="plot_path", type=output_file(".png", ".svg", ".pdf"),
                   help="draw latency and throughput here (needs matplotlib: pip install matplotlib)")
    p.add_argument("--replot", metavar="JSON", type=input_file, help="only draw --plot (and print the table) from an "
                   "earlier --json")
    p.add_argument("--sidecar-log", type=output_file(), help="copy the spawned sidecar's log (graph capture lines) "
                   "here (the spawned sidecar's temp folder is removed at exit)")
    p.add_argument("--transport", action="store_true",
                   help="instead: per-chunk round trip of inline bytes vs CUDA IPC against the in-process decode")
    p.add_argument("--transport-batch", type=int_at_least(1), default=16, help="--transport: the sidecar's max batch size")
    p.add_argument("--transport-chunks", type=int_at_least(1), default=1000, help="--transport: chunks per level and transport")
    p.add_argument("--stages", action="store_true", help="instead: where one chunk's time goes at concurrency 1, stage "
                   "by stage (client, wire, sidecar decode, wait, launch, device, reply, wire, client), inputs on "
                   "the host and (CUDA) on the device; docs/performance.md")
    p.add_argument("--stages-chunks", type=int_at_least(1), default=200, help="--stages: timed chunks per kind of "
                   "inputs, of --chunk-frames frames each, in one stream")
    p.add_argument("--stages-warmup", type=int_at_least(0), default=10, help="--stages: untimed chunks first")
    p.add_argument("--stages-busy-ms", type=float, default=5.0, help="--stages on CUDA, the hand-off table: GPU work "
                   "before each chunk's codes are made (the talker's step), during which the message is sent")
    p.add_argument("--stages-loop-profile", type=int_at_least(0), default=0, help="--stages: also profile the "
                   "sidecar's loop thread over each kind's timed chunks (profile_loop) and print its N functions with "
                   "the most self time per chunk; the stage table of such a run is slowed by the profiler")
    add_stock_args(p)
    add_upstream_args(p)
    return p


def environment(device: torch.device, dtype: str, model: str) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": str(device), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
            "dtype": dtype, "model": model,
            "bench_cpu_threads": torch.get_num_threads()}  # this process's (the sidecar's is in its ready line)


def build_phases(args: argparse.Namespace, device: torch.device) -> list[Phase]:
    """The phases of a run, in order (add new ones here; see phases.py)."""
    phases: list[Phase] = []
    if not args.no_baselines:
        phases.append(BaselinesPhase(args, device))
    if not args.no_sidecar:
        phases.append(SidecarPhase(args, device))
    return phases


def replot(args: argparse.Namespace) -> int:
    report = load(args.replot)
    print_table(report)
    if args.plot_path:
        plot(args.plot_path, report)
        print(f"wrote {args.plot_path}")
    return 0


def finish(report: BenchReport, args: argparse.Namespace) -> None:
    print_table(report)
    if args.json_path:
        report.write(args.json_path)
        print(f"wrote {args.json_path}" + (" (interrupted: partial)" if report.interrupted else ""))
    if args.plot_path and report.results:
        plot(args.plot_path, report)
        print(f"wrote {args.plot_path}")


def main(argv: list[str] | None = None) -> int:
    """One run of the given flags, or each run of the ``--scenario`` names (the worst exit status of them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        names, rest = split_scenario(argv)
        runs = expand(names, rest) if names is not None else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if runs is None:
        return run_once(rest, None)
    status = 0
    for run in runs:
        print(f"[bench] scenario {run.label}: code2wav-sidecar bench {' '.join(run.argv)}", file=sys.stderr, flush=True)
        status = max(status, run_once(list(run.argv), run.label))
        if status == EXIT_INTERRUPTED:
            break
    return status


def run_once(argv: list[str], scenario: str | None) -> int:
    args = build_parser().parse_args(argv)
    args.scenario = scenario  # the run's name, recorded in the report's settings
    if args.plot_path:
        try:
            check_plot_available()
        except PlotUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.replot:
        return replot(args)
    from code2wav.sidecar.cli_checks import check_device
    from code2wav.sidecar.cpu_dtype import cpu_dtype_warning
    from code2wav.sidecar.models import configure_cuda, resolve_device
    from code2wav.sidecar.models.registry import check_model_spec

    uses_model = args.address is None or not args.no_baselines
    problem = check_device(args.device) or (check_model_spec(args.model) if uses_model else None)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    device = resolve_device(args.device)
    for dest, (gpu_default, cpu_default) in DEVICE_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, cpu_default if device.type == "cpu" else gpu_default)
    warning = cpu_dtype_warning(device.type, args.dtype)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if args.transport:
        from .transport_bench import run as run_transport

        return run_transport(args)
    if args.stages:
        from .stages import run as run_stages

        return run_stages(args)
    from code2wav.client.discovery import parse_pool_address

    if args.drivers > 1 and args.address is not None and parse_pool_address(args.address).pooled:
        print("error: --drivers drives one sidecar: a pool's per-sidecar figures need the streams in one process "
              "(leave --drivers at 1 with a pool address)", file=sys.stderr)
        return 2
    if args.early_audio and args.inputs_on != "device":
        print("error: --early-audio applies to CUDA IPC audio: add --inputs-on device", file=sys.stderr)
        return 2
    if args.inputs_on == "device" and (args.no_sidecar or device.type != "cuda"):
        reason = "--no-sidecar runs no sidecar levels" if args.no_sidecar else f"got --device {device}"
        print(f"error: --inputs-on device needs sidecar levels on a CUDA device; {reason}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        configure_cuda()  # the server's defaults, so baselines and sidecar run the same math
    settings = {k: v for k, v in vars(args).items() if k not in ("json_path", "plot_path", "server_key")}
    report = BenchReport(environment(device, args.dtype, args.model), settings)
    try:
        run_phases(build_phases(args, device), report, Progress())
    except KeyboardInterrupt:
        finish(report, args)
        return EXIT_INTERRUPTED
    finish(report, args)
    return 1 if any(r["errors"] for r in report.results) else 0


if __name__ == "__main__":
    sys.exit(main())
