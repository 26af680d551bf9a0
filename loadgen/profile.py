"""``code2wav-sidecar profile``: where the time of one exact step goes, kernel by kernel (or with ``--by layer``, layer
by layer as a roofline: ``roofline.py``).

Loads ``--model`` (a folder, ``default``, ``voxcpm2-default``) on ``--device`` in ``--dtype``, stages a batch of
``--batch`` synthetic chunks of ``--frames`` frames and runs the step a CUDA graph would capture (the routine's
forward: state gather, the decoder, state scatter) without a graph, under ``torch.profiler``. On a GPU each row is
a device kernel (or copy) it launched; on the CPU, where there are no kernels, an operator with its self time (its
time less its child operators': the rows add up to the step's operator time once). Per row: calls per step, total
and mean time per step, share of the summed time. The figures
are the means over ``--steps`` profiled steps, after ``--warmup`` untimed ones (first-call work: each conv's and
GEMM's form is measured on its first call). The step's wall time is timed apart, without the profiler.

Prints the table (``--top`` rows; the rest summed in one line) and, on a GPU, the form each conv and GEMM chose;
``--json`` writes all of it. The bench's ``--profile-batch`` prints the same table (``baselines.profile_kernels``).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from code2wav.sidecar.cli_checks import DEVICE_HELP, OneLineParser, UsageError, device_arg, int_at_least, output_file
from code2wav.sidecar.cli_help import DTYPE_CHOICES, DefaultsHelpFormatter, command_epilog

from .roofline import format_layers, profile_layers
from .step_stage import check_sizes, chosen_forms, staged_step
from .timing import sync_device, time_calls

NAME_WIDTH = 100  # characters of a kernel's name in the text table (the JSON keeps the whole name)
DESCRIPTION = ("Time one decode step of a model, kernel by kernel on a GPU (device time) or operator by operator on "
               "the CPU (self time): a batch of --batch synthetic chunks of --frames frames, run --steps times "
               "under torch.profiler after --warmup untimed steps. Prints the top rows and the step's wall time; "
               "--json writes everything.")
EXAMPLE = "code2wav-sidecar profile --device cpu --batch 1 --frames 25"


@dataclass(frozen=True)
class KernelRow:
    name: str
    calls: float  # per step
    total_us: float  # per step
    mean_us: float  # per call
    share: float  # of the summed time of every row


@dataclass
class StepProfile:
    model: str
    device: str
    dtype: str
    batch: int
    num_frames: int
    steps: int
    unit: str  # what a row is: "kernel" (GPU: device time) or "operator" (CPU: self time)
    total_us: float  # summed over the rows, per step
    calls: float  # per step
    step_ms_p50: float  # the step's wall time, timed without the profiler
    profiled_step_ms: float  # the wall time of a profiled step (the profiler's overhead included)
    kernels: list[KernelRow]
    choices: list[dict] = field(default_factory=list)  # each measured conv/GEMM form (GPU)


def profile_step(model, batch: int, num_frames: int, steps: int = 3, warmup: int = 2) -> StepProfile:
    """Profile the graph-free exact step of ``model`` (a loaded sidecar model) at ``batch`` x ``num_frames``."""
    check_sizes(batch, num_frames, steps, warmup)
    with torch.inference_mode():
        step = staged_step(model, batch, num_frames)
        step_s = time_calls(step, model.device, iters=steps, warmup=warmup)
        t0 = time.perf_counter()
        events = _profiled_events(step, model.device, steps)
        profiled_ms = (time.perf_counter() - t0) * 1e3 / steps
    gpu = model.device.type == "cuda"
    rows = _rows(events, steps)
    total_us = sum(r.total_us for r in rows)
    return StepProfile(
        model=model.name, device=str(model.device), dtype=str(model.dtype).replace("torch.", ""),
        batch=batch, num_frames=num_frames, steps=steps, unit="kernel" if gpu else "operator",
        total_us=total_us, calls=sum(r.calls for r in rows), step_ms_p50=statistics.median(step_s) * 1e3,
        profiled_step_ms=profiled_ms, kernels=rows, choices=chosen_forms(model.module) if gpu else [])


def _profiled_events(step, device: torch.device, steps: int) -> list[tuple[str, float]]:
    """``(name, us)`` of every kernel (GPU) or operator (CPU, its self time) of ``steps`` calls of ``step``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync_device(device)
    if gpu:
        return [(e.name, e.device_time) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type == DeviceType.CPU]


def _rows(events: list[tuple[str, float]], steps: int) -> list[KernelRow]:
    """One row per name, per step, most time first."""
    calls: dict[str, int] = defaultdict(int)
    time_us: dict[str, float] = defaultdict(float)
    for name, us in events:
        calls[name] += 1
        time_us[name] += us
    total = sum(time_us.values()) or 1.0
    rows = [KernelRow(name=name, calls=calls[name] / steps, total_us=time_us[name] / steps,
                      mean_us=time_us[name] / calls[name], share=time_us[name] / total)
            for name in time_us]
    return sorted(rows, key=lambda r: (-r.total_us, r.name))


def format_table(p: StepProfile, top: int | None = 20) -> str:
    """The profile as text: a title line, one line per row (``top`` of them, the rest summed), the choices."""
    lines = [f"{p.model or 'model'}, {p.dtype}, {p.device}: one exact step (no graph), batch {p.batch} x "
             f"{p.num_frames} frames, mean of {p.steps} profiled steps: {p.calls:g} {p.unit} calls, "
             f"{p.total_us:.1f} us summed; step wall time p50 {p.step_ms_p50:.3f} ms (unprofiled)",
             f"{'total us':>10} {'calls':>7} {'mean us':>9} {'share':>6}  "
             + ("kernel (device time)" if p.unit == "kernel" else "operator (self time)")]
    shown = p.kernels if top is None else p.kernels[:top]
    for r in shown:
        lines.append(f"{r.total_us:10.1f} {r.calls:7g} {r.mean_us:9.1f} {100 * r.share:5.1f}%  {r.name[:NAME_WIDTH]}")
    rest = p.kernels[len(shown):]
    if rest:
        lines.append(f"{sum(r.total_us for r in rest):10.1f} {sum(r.calls for r in rest):7g} {'':>9} "
                     f"{100 * sum(r.share for r in rest):5.1f}%  ({len(rest)} more)")
    for c in p.choices:
        forms = " ".join(f"{form} {us:g}" for form, us in c["timings_us"].items())
        lines.append(f"  {c['kind']} {c['module']} {c['shape']}: {c['chosen']} (us: {forms})")
    return "\n".join(lines)


def conv_form_families(text: str | None) -> tuple[str, ...] | None:
    """``--conv-forms``'s families, or None (all); an unknown name is an error naming the known ones."""
    if not text:
        return None
    from code2wav.sidecar.kernels.conv_forms import FAMILIES

    names = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"--conv-forms: unknown form {', '.join(unknown)} (known: {', '.join(FAMILIES)}; "
                         "cuDNN is always offered)")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="code2wav-sidecar profile", description=DESCRIPTION, formatter_class=DefaultsHelpFormatter,
                      epilog=command_epilog(EXAMPLE))
    p.add_argument("--model", default="default", help="a model folder, or 'default' / 'voxcpm2-default' (random "
                   "weights)")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--batch", type=int_at_least(1), default=1, help="rows in the step")
    p.add_argument("--frames", type=int_at_least(1), default=25, help="new frames per row")
    p.add_argument("--steps", type=int_at_least(1), default=3, help="profiled steps, averaged")
    p.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed steps first")
    p.add_argument("--top", type=int_at_least(0, " (0: all)"), default=20, help="rows printed (the rest summed in "
                   "one line); 0: all")
    p.add_argument("--by", choices=("kernel", "layer"), default="kernel",
                   help="rows: each kernel (or CPU operator), or each layer as a roofline (time, GFLOP, MB, "
                        "achieved TFLOP/s and GB/s against the GPU's peaks, share, kernel names)")
    p.add_argument("--conv-forms", default=None,
                   help="comma-separated conv form families the dense convs may choose from (cuDNN always): "
                        "cudnn_cl, polyphase, gemm, gemm_cl, gemm_tma, im2col, unit_tma (a residual unit's conv1 "
                        "with its rest); default: all (a before/after view)")
    p.add_argument("--json", dest="json_path", type=output_file(), help="write the whole profile here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_sizes(args.batch, args.frames, args.steps, args.warmup)
        allowed = conv_form_families(args.conv_forms)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from code2wav.sidecar.kernels.choice_cache import ChoiceEvents
    from code2wav.sidecar.kernels.conv_choice import attach_choices
    from code2wav.sidecar.cli_checks import check_device
    from code2wav.sidecar.cpu_dtype import cpu_dtype_warning
    from code2wav.sidecar.models import configure_cuda, load_model, resolve_device
    from code2wav.sidecar.models.registry import check_model_spec

    problem = check_device(args.device) or check_model_spec(args.model)
    if problem is not None:
        raise UsageError(problem)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = resolve_device(args.device)
    warning = cpu_dtype_warning(device.type, args.dtype)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if device.type == "cuda":
        configure_cuda()  # the server's math (TF32 off), as the bench's baselines
    model = load_model(args.model, device, args.dtype)
    attach_choices(model.module, None, ChoiceEvents(), allowed)  # named for the log; measured here, not cached
    if args.by == "layer":
        found = profile_layers(model, args.batch, args.frames, args.steps, args.warmup)
        found.model = args.model
        print(format_layers(found))
    else:
        found = profile_step(model, args.batch, args.frames, args.steps, args.warmup)
        found.model = args.model
        print(format_table(found, args.top or None))
    if args.json_path:
        environment = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                       "torch": torch.__version__, "python": platform.python_version()}
        settings = {k: v for k, v in vars(args).items() if k != "json_path"}
        report = {"environment": environment, "settings": settings, **asdict(found)}
        with open(args.json_path, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
