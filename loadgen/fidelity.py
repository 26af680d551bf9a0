"""``code2wav-sidecar fidelity``: how far each streaming path drifts from one forward over all frames.

Decodes ``--streams`` seeded random streams of ``--frames`` frames, each once without and once with
``--context-frames`` reference frames in front (voice-clone context: decoded into the state, no audio), through

- ``oneshot``: our model's forward over all frames at once (the reference, path (a));
- ``stock``: vLLM-Omni 0.30's own streaming path (``Qwen3TTSCode2Wav`` with its per-request decoder state cache,
  configured by its deploy file: first chunk 1 frame, then 25; see ``loadgen/stock.py``);
- ``exact``: a real sidecar (spawned), exact mode, same chunks;
- ``window``: the same sidecar, window mode (stateless ``--window-left-context`` frames of left context);

and prints the max and mean absolute error and the SNR of each against ``oneshot``, also split at the decoder's
sliding window (frames before it and after it). ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time

import torch

from code2wav.sidecar.cli_checks import DEVICE_HELP, OneLineParser, UsageError, device_arg, int_at_least, output_file
from code2wav.sidecar.cli_help import DTYPE_CHOICES, DefaultsHelpFormatter, command_epilog

from .traffic import chunk_sizes, synthetic_codes

PATHS = ("oneshot", "stock", "exact", "window")
DESCRIPTION = ("Measure how far each streaming path drifts from one decode of all frames (oneshot): vLLM-Omni's own "
               "streaming (stock, needs vllm-omni), and a spawned sidecar in exact and window mode. Each of --streams "
               "seeded streams runs once without and once with --context-frames reference frames in front. Prints "
               "max/mean absolute error and SNR per path (Qwen3-TTS codes models).")
EXAMPLE = "code2wav-sidecar fidelity --device cpu --paths exact,window --frames 100"


def paths_arg(text: str) -> str:
    paths = [p for p in text.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS[1:]))
    if unknown or not paths:
        raise argparse.ArgumentTypeError(f"{text!r}: choose comma-separated paths from {', '.join(PATHS[1:])}")
    return text

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="code2wav-sidecar fidelity", description=DESCRIPTION,
                      formatter_class=DefaultsHelpFormatter, epilog=command_epilog(EXAMPLE))
    p.add_argument("--model", default="default", help="a Qwen3-TTS speech_tokenizer/ folder or 'default' (seeded "
                   "random weights)")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--streams", type=int_at_least(1), default=1, help="seeded random streams (each without and with "
                   "context)")
    p.add_argument("--frames", type=int_at_least(1), default=240, help="new frames per stream (after the context "
                   "frames)")
    p.add_argument("--context-frames", type=int_at_least(0), default=48,
                   help="reference frames in front of the second variant of each stream (0: only the first variant)")
    p.add_argument("--first-chunk-frames", type=int_at_least(0), default=1, help="frames in each stream's first "
                   "chunk (0: no separate first chunk)")
    p.add_argument("--chunk-frames", type=int_at_least(1), default=25, help="frames in each later chunk")
    p.add_argument("--window-left-context", type=int_at_least(0), default=72, help="window mode's left context "
                   "frames")
    p.add_argument("--paths", type=paths_arg, default=",".join(PATHS[1:]), help="comma-separated, of "
                   f"{', '.join(PATHS[1:])}")
    p.add_argument("--seed", type=int, default=0, help="first stream's seed")
    p.add_argument("--json", dest="json_path", type=output_file(), help="write every number here")
    return p


def compare(got: torch.Tensor, want: torch.Tensor, samples_per_frame: int, window_frames: int) -> dict:
    """Errors of ``got`` against ``want`` (both ``[N]``): whole, before and after ``window_frames`` frames."""
    if got.shape != want.shape:
        raise ValueError(f"audio lengths differ: {tuple(got.shape)} vs reference {tuple(want.shape)}")
    err = (got.double() - want.double()).abs()  # [N]
    split = min(err.numel(), window_frames * samples_per_frame)
    noise = float(err.pow(2).sum())
    signal = float(want.double().pow(2).sum())
    return {
        "max_abs": float(err.max()), "mean_abs": float(err.mean()),
        "snr_db": math.inf if noise == 0 else 10 * math.log10(signal / noise),
        "max_abs_in_window": float(err[:split].max()) if split else 0.0,
        "mean_abs_in_window": float(err[:split].mean()) if split else 0.0,
        "max_abs_after_window": float(err[split:].max()) if err.numel() > split else None,
        "mean_abs_after_window": float(err[split:].mean()) if err.numel() > split else None,
    }


def _sidecar_stream(client, mode: str, codes: torch.Tensor, sizes: list[int], context_frames: int,
                    left_context_frames: int, stream_id: str) -> torch.Tensor:
    stream = client.open_stream(stream_id, mode=mode, left_context_frames=left_context_frames)
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        ctx = context_frames if i == 0 else 0
        end = start + ctx + size
        pieces.append(stream.decode(codes[:, start:end].contiguous(), final=i == len(sizes) - 1, context_frames=ctx))
        start = end
    return torch.cat(pieces).float().cpu()


def run(args: argparse.Namespace) -> dict:
    from code2wav.sidecar.models import configure_cuda, load_model, resolve_device

    from code2wav.sidecar.cli_checks import check_device
    from code2wav.sidecar.models.registry import check_model_spec

    paths = [p for p in args.paths.split(",") if p]
    from .stock_shim import vllm_omni_installed

    problem = check_device(args.device) or check_model_spec(args.model)
    if problem is not None:
        raise UsageError(problem)
    if "stock" in paths and not vllm_omni_installed():
        raise UsageError("--paths stock (a default) needs vllm-omni, which is not installed: pip install "
                         "vllm-omni==0.30.0, or leave it out: --paths exact,window")
    device = resolve_device(args.device)
    if device.type == "cuda":
        configure_cuda()  # the sidecar's math (TF32 off): the one-shot reference and stock run as the server does
    model = load_model(args.model, device, args.dtype)
    if not model.input.is_integer:
        raise UsageError(f"--model {args.model}: fidelity compares Qwen3-TTS codes paths; this model takes latents")
    window = model.module.cfg.sliding_window
    if args.context_frames > window and "stock" in paths:
        raise UsageError(f"--context-frames {args.context_frames}: vLLM-Omni's first chunk holds at most "
                         f"{window} reference frames (the decoder's sliding window); give at most {window}")
    sizes = chunk_sizes(args.frames, args.first_chunk_frames, args.chunk_frames)
    cases = []
    for i in range(args.streams):
        for ctx in sorted({0, args.context_frames}):
            codes = synthetic_codes(model.num_quantizers, ctx + args.frames, model.codebook_size, seed=args.seed + i)
            cases.append({"stream": i, "context_frames": ctx, "codes": codes})
    U = model.samples_per_frame
    audio: dict[str, list[torch.Tensor]] = {p: [] for p in PATHS}
    timing_s: dict[str, float] = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        for case in cases:
            wav = model.module(case["codes"][None].to(device))[0, 0].float().cpu()  # [(ctx + T) * U]
            audio["oneshot"].append(wav[case["context_frames"] * U:])
    timing_s["oneshot"] = time.perf_counter() - t0
    print(f"oneshot: {len(cases)} streams in {timing_s['oneshot']:.1f} s", flush=True)
    extra: dict = {}
    if "stock" in paths:
        from .stock import build_stock

        stock = build_stock(model)
        extra["vllm_shim"] = stock.vllm_shim
        extra["stock_settings"] = stock.settings
        print(f"vllm-omni-stock: vllm_shim={stock.vllm_shim} graphs={stock.graphs}", flush=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            for n, case in enumerate(cases):
                audio["stock"].append(stock.stream(case["codes"], sizes, case["context_frames"], f"fid-{n}"))
        timing_s["stock"] = time.perf_counter() - t0
        print(f"stock: {timing_s['stock']:.1f} s", flush=True)
        del stock
    del model
    sidecar_paths = [p for p in ("exact", "window") if p in paths]
    if sidecar_paths:
        _run_sidecar_paths(args, device, sidecar_paths, cases, sizes, audio, timing_s)
    return _report(args, device, paths, cases, audio, timing_s, U, window, extra)


def _run_sidecar_paths(args, device, sidecar_paths, cases, sizes, audio, timing_s) -> None:
    from code2wav.client import SidecarClient

    from .spawn import spawn_sidecar

    spawned = spawn_sidecar("--model", args.model, "--device", str(device), "--dtype", args.dtype)
    print(spawned.ready_line, flush=True)
    try:
        with SidecarClient(spawned.address, timeout_s=600) as client:
            for mode in sidecar_paths:
                t0 = time.perf_counter()
                for n, case in enumerate(cases):
                    audio[mode].append(_sidecar_stream(client, mode, case["codes"], sizes, case["context_frames"],
                                                       args.window_left_context, f"fid-{mode}-{n}"))
                timing_s[mode] = time.perf_counter() - t0
                print(f"{mode}: {timing_s[mode]:.1f} s", flush=True)
    finally:
        spawned.stop()


def _report(args, device, paths, cases, audio, timing_s, U, window, extra) -> dict:
    rows = []
    for path in paths:
        for case, got, want in zip(cases, audio[path], audio["oneshot"]):
            rows.append({"path": path, "stream": case["stream"], "context_frames": case["context_frames"],
                         "frames": args.frames, **compare(got, want, U, window)})
    print(f"\nfidelity against one forward over all frames ({args.frames} frames, chunks "
          f"{args.first_chunk_frames} then {args.chunk_frames}; 'window' columns: the first {window} frames)")
    print(f"{'path':<7} {'stream':>6} {'ctx':>4} {'max_abs':>10} {'mean_abs':>10} {'snr_db':>8} "
          f"{'max_in_win':>10} {'max_after':>10} {'mean_after':>10}")

    def fmt(v):
        return f"{v:>10.2e}" if v is not None else f"{'-':>10}"

    for r in rows:
        print(f"{r['path']:<7} {r['stream']:>6} {r['context_frames']:>4} {fmt(r['max_abs'])} {fmt(r['mean_abs'])} "
              f"{r['snr_db']:>8.1f} {fmt(r['max_abs_in_window'])} {fmt(r['max_abs_after_window'])} "
              f"{fmt(r['mean_abs_after_window'])}")
    if "vllm_shim" in extra:
        print(f"vllm_shim: {str(extra['vllm_shim']).lower()}")
    report = {"environment": {"device": str(device), "dtype": args.dtype, "model": args.model,
                              "torch": torch.__version__},
              "settings": {k: v for k, v in vars(args).items() if k != "json_path"},
              "sliding_window_frames": window, "timing_s": timing_s, "results": rows, **extra}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_path}")
    return report


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    run(args)
    return 0
