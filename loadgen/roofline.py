"""``code2wav-sidecar profile --by layer``: one exact step as a per-layer roofline table.

A layer is a module of the decoder at the depth where its work is one job: the walk (``layers``) descends through
containers (``ModuleList``, ``StreamSequential``, ``Sequential``) and through modules that hold one (a transformer's
layer list, a decoder block's chain), and stops at every other module (a conv, a transposed conv, a residual unit, a
transformer layer, a ConvNeXt block, a Snake). Per layer, for one step (the routine's graph-free forward, as
``profile.py`` stages it):

- ``kernel_us``: the device time of the kernels it launched (``torch.profiler``: each kernel is attributed to the
  layer whose ``record_function`` range launched it), with their names; on the CPU the operators' time.
- ``span_us``: the wall time between the layer's first and last launch on the device (CUDA events; on the GPU this
  includes any idle gap while the host launches, which a captured graph does not have).
- ``gflop``: matmul and conv FLOPs (``FlopCounterMode``, read before and after the layer: the bench's count);
  ``mbytes``: the compulsory traffic, the layer's input and output tensors and its weights (a lower bound: a
  layer's intermediate tensors and state copies are not in it).
- achieved ``tflops`` and ``gbps`` over ``kernel_us``, and the fraction of the GPU's peaks they reach
  (``PEAKS``): ``compute`` against the dtype's tensor-core peak, ``memory`` against its bandwidth. The larger one says
  what bounds the layer; both far below 1 say the kernels, not the GPU, are what to fix.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from .flops import peak_flops
from .step_stage import check_sizes, chosen_forms, staged_step

PEAK_BYTES_PER_S: dict[str, float] = {"H200": 4.8e12, "H100": 3.35e12}
"""(substring of the GPU's name) -> HBM bandwidth, bytes/s (NVIDIA's datasheets, SXM parts)."""

CONTAINERS = ("ModuleList", "StreamSequential", "Sequential")


@dataclass
class LayerRow:
    name: str
    kind: str  # the module's class
    kernel_us: float
    span_us: float
    gflop: float
    mbytes: float
    tflops: float  # achieved, over kernel_us
    gbps: float
    compute_frac: float | None  # of the peak FLOP/s (None: unknown peak)
    memory_frac: float | None
    share: float  # of the step's summed kernel time
    calls: float  # kernels per step
    kernels: list[str] = field(default_factory=list)  # names, most time first


@dataclass
class LayerProfile:
    model: str
    device: str
    gpu: str | None
    dtype: str
    batch: int
    num_frames: int
    steps: int
    unit: str  # "kernel" (GPU) or "operator" (CPU)
    peak_tflops: float | None
    peak_gbps: float | None
    total_us: float
    unattributed_us: float  # kernels launched outside every layer (the routine's state gather and scatter)
    layers: list[LayerRow]
    not_called: list[str] = field(default_factory=list)  # layers whose work ran inside a neighbour's kernels
    choices: list[dict] = field(default_factory=list)  # each conv/GEMM form chosen, with every form's time (GPU)


def layers(module: nn.Module, prefix: str = "", groups: list | None = None) -> list[tuple[str, nn.Module]]:
    """The layers of ``module`` (the module docstring), in order of definition, with their paths. ``groups``, when
    given, collects the non-container modules the walk descended through (a block that may run its layers' work
    itself, without calling them: then it is the layer, ``profile_layers`` decides from what ran)."""
    found = []
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        container = type(child).__name__ in CONTAINERS
        if container or any(type(c).__name__ in CONTAINERS for c in child.children()):
            if not container and groups is not None:
                groups.append((path, child))
            found += layers(child, path, groups)
        else:
            found.append((path, child))
    return found


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


class _LayerHooks:
    """Forward hooks on each layer: a ``record_function`` range, CUDA events, FLOP and byte counts."""

    def __init__(self, named: list[tuple[str, nn.Module]], device: torch.device) -> None:
        self.named, self.device = named, device
        self.flops: dict[str, float] = defaultdict(float)
        self.nbytes: dict[str, float] = defaultdict(float)
        self.spans: dict[str, list] = defaultdict(list)
        self.counter = None  # a FlopCounterMode while counting
        self.events = False  # CUDA events while timing spans
        self.ranges = False  # record_function ranges while profiling
        self._open: dict[str, tuple] = {}
        self._handles = []

    def __enter__(self):
        for name, module in self.named:
            weights = sum(p.numel() * p.element_size() for p in module.parameters())
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, n=name, w=weights: self._pre(n, w, args, kwargs), with_kwargs=True))
            self._handles.append(module.register_forward_hook(lambda m, args, out, n=name: self._post(n, out)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, name: str, weights: int, args, kwargs) -> None:
        rng = torch.ops.profiler._record_function_enter_new(f"layer:{name}") if self.ranges else None
        start = None
        if self.events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        flops = self.counter.get_total_flops() if self.counter is not None else 0
        if self.counter is not None:
            self.nbytes[name] += weights + _nbytes(args) + _nbytes({k: v for k, v in kwargs.items() if k != "ctx"})
        self._open[name] = (rng, start, flops)

    def _post(self, name: str, out) -> None:
        rng, start, flops = self._open.pop(name)
        if self.counter is not None:
            self.flops[name] += self.counter.get_total_flops() - flops
            self.nbytes[name] += _nbytes(out)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans[name].append((start, end))
        if rng is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(rng)


def _own_work(named: list[tuple[str, nn.Module]], group_names: set[str],
              hooks: _LayerHooks) -> tuple[dict[str, float], dict[str, float]]:
    """Per row, its own FLOPs and compulsory bytes: a layer's all; a group's less those of the rows inside it (its
    bytes: the weights no row inside it holds, as its inputs and outputs are its layers')."""
    names = [n for n, _ in named]

    def inner(group: str) -> list[str]:  # the rows directly inside ``group`` (not inside a group inside it)
        return [n for n in names if n.startswith(group + ".") and not any(
            g != group and g.startswith(group + ".") and n.startswith(g + ".") for g in names if g in group_names)]

    flops, nbytes = {}, {}
    for name, module in named:
        if name not in group_names:
            flops[name], nbytes[name] = hooks.flops.get(name, 0.0), hooks.nbytes.get(name, 0.0)
            continue
        below = inner(name)
        flops[name] = max(hooks.flops.get(name, 0.0) - sum(hooks.flops.get(n, 0.0) for n in below), 0.0)
        held = {id(p) for n, m in named if n.startswith(name + ".") for p in m.parameters()}
        nbytes[name] = float(sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in held))
    return flops, nbytes


def _attributed(prof, gpu: bool) -> tuple[dict[str, dict[str, list[float]]], float]:
    """Per layer, ``{kernel or operator name: [us, ...]}`` of the profiled steps, and the time outside every layer."""
    per_layer: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    inside = 0.0
    for event in prof.events():
        if not event.name.startswith("layer:"):
            continue
        layer = event.name[len("layer:"):]
        stack = [event]
        while stack:
            e = stack.pop()
            if e is not event and e.name.startswith("layer:"):
                continue  # a layer inside a group: counted as its own
            if gpu:
                for k in e.kernels:
                    per_layer[layer][k.name].append(k.duration)
                    inside += k.duration
            elif e is not event:
                per_layer[layer][e.name].append(e.self_cpu_time_total)
                inside += e.self_cpu_time_total
            stack.extend(e.cpu_children)
    return per_layer, inside


def profile_layers(model, batch: int, num_frames: int, steps: int = 3, warmup: int = 2) -> LayerProfile:
    """Profile the graph-free exact step of ``model`` at ``batch`` x ``num_frames`` per layer."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    from .timing import sync_device

    check_sizes(batch, num_frames, steps, warmup)
    gpu = model.device.type == "cuda"
    groups: list[tuple[str, nn.Module]] = []
    leaves = layers(model.module, groups=groups)
    with torch.inference_mode(), _LayerHooks(leaves + groups, model.device) as hooks:
        step = staged_step(model, batch, num_frames)
        for _ in range(warmup):
            step()  # first-call work (each conv's form measured on its first call) stays out
        sync_device(model.device)
        with FlopCounterMode(display=False) as counter:
            hooks.counter = counter
            step()
        hooks.counter = None
        if gpu:
            hooks.events = True
            for _ in range(steps):
                torch.cuda._sleep(20_000_000)  # a head start (~10 ms): the host queues the step before the GPU runs it
                step()
            sync_device(model.device)
            hooks.events = False
        hooks.ranges = True
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            for _ in range(steps):
                step()
            sync_device(model.device)
        hooks.ranges = False
    fired = set(hooks.nbytes)  # every layer called in the counted step (its weights and inputs are counted then)
    # a layer never called is left out (its work is fused into a neighbour's kernel, e.g. a Snake into the next
    # conv's input); a group is a row of its own work (what it ran between and instead of its layers' calls: a
    # residual unit's 1x1 GEMM, a transformer's layers run by the block itself), where it has any
    order = {name: i for i, (name, _) in enumerate(model.module.named_modules())}  # a group before its layers
    named = sorted([(n, m) for n, m in leaves + groups if n in fired], key=lambda nm: order[nm[0]])
    group_names = {n for n, _ in groups}
    own_flops, own_nbytes = _own_work(named, group_names, hooks)
    per_layer, inside = _attributed(prof, gpu)
    # device events less the GPU-side copies of the layer ranges (Kineto's user annotations on the GPU timeline)
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA
                     and not e.name.startswith("layer:")] if gpu else []
    total_us = (sum(e.device_time for e in device_events) if gpu else inside) / steps
    gpu_name = torch.cuda.get_device_name(model.device) if gpu else None
    dtype = str(model.dtype).replace("torch.", "")
    peak_flop_s = peak_flops(gpu_name, dtype)[0] if gpu else None
    peak_byte_s = next((v for k, v in PEAK_BYTES_PER_S.items() if gpu_name and k in gpu_name), None)
    rows = []
    for name, module in named:
        kernels = per_layer.get(name, {})
        kernel_us = sum(sum(v) for v in kernels.values()) / steps
        flop, nbytes = own_flops[name], own_nbytes[name]
        if name in group_names and not (kernel_us or flop):
            continue  # a group that only called its layers
        spans = hooks.spans.get(name, []) if name not in group_names else []
        span_us = sum(s.elapsed_time(e) for s, e in spans) * 1e3 / steps if spans else kernel_us
        seconds = kernel_us * 1e-6
        tflops = flop / seconds / 1e12 if seconds else 0.0
        gbps = nbytes / seconds / 1e9 if seconds else 0.0
        rows.append(LayerRow(
            name=name, kind=type(module).__name__ + (", own work" if name in group_names else ""),
            kernel_us=kernel_us, span_us=span_us, gflop=flop / 1e9,
            mbytes=nbytes / 1e6, tflops=tflops, gbps=gbps,
            compute_frac=tflops * 1e12 / peak_flop_s if peak_flop_s else None,
            memory_frac=gbps * 1e9 / peak_byte_s if peak_byte_s else None,
            share=kernel_us / total_us if total_us else 0.0, calls=sum(len(v) for v in kernels.values()) / steps,
            kernels=[k for k, _ in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))]))
    attributed_us = sum(r.kernel_us for r in rows)
    not_called = [n for n, _ in leaves if n not in fired]
    return LayerProfile(
        model=model.name, device=str(model.device), gpu=gpu_name, dtype=dtype, batch=batch, num_frames=num_frames,
        steps=steps, unit="kernel" if gpu else "operator",
        peak_tflops=peak_flop_s / 1e12 if peak_flop_s else None, peak_gbps=peak_byte_s / 1e9 if peak_byte_s else None,
        total_us=total_us, unattributed_us=max(total_us - attributed_us, 0.0), layers=rows, not_called=not_called,
        choices=chosen_forms(model.module) if gpu else [])


def format_layers(p: LayerProfile, kernel_width: int = 60) -> str:
    """The profile as text: a title, one line per layer (in order), the totals."""
    peaks = (f"peaks {p.peak_tflops:g} TFLOP/s, {p.peak_gbps:g} GB/s" if p.peak_tflops and p.peak_gbps
             else "peaks unknown for this device")
    lines = [f"{p.model}, {p.dtype}, {p.gpu or p.device}: one exact step (no graph), batch {p.batch} x "
             f"{p.num_frames} frames, mean of {p.steps} steps; {p.total_us:.1f} us of {p.unit}s "
             f"({p.unattributed_us:.1f} outside the layers); {peaks}",
             f"{'kernel us':>10} {'span us':>9} {'share':>6} {'GFLOP':>8} {'MB':>8} {'TFLOP/s':>8} {'GB/s':>7} "
             f"{'%comp':>6} {'%mem':>5}  layer (kind): top {p.unit}s"]

    def pct(frac: float | None) -> str:
        return f"{100 * frac:5.1f}" if frac is not None else "    -"

    for r in p.layers:
        top = ", ".join(k[:kernel_width] for k in r.kernels[:2])
        lines.append(f"{r.kernel_us:10.1f} {r.span_us:9.1f} {100 * r.share:5.1f}% {r.gflop:8.2f} {r.mbytes:8.1f} "
                     f"{r.tflops:8.1f} {r.gbps:7.0f} {pct(r.compute_frac):>6} {pct(r.memory_frac):>5}  "
                     f"{r.name} ({r.kind}): {top}")
    flop = sum(r.gflop for r in p.layers)
    attributed = p.total_us - p.unattributed_us
    achieved = flop * 1e9 / (p.total_us * 1e-6) / 1e12 if p.total_us else 0.0
    lines.append(f"{attributed:10.1f} {'':>9} {'':>6} {flop:8.2f} {'':>8} {achieved:8.1f}   step: {flop:.2f} GFLOP "
                 f"over {p.total_us:.1f} us = {achieved:.1f} TFLOP/s"
                 + (f" ({100 * achieved / p.peak_tflops:.1f} % of peak)" if p.peak_tflops else ""))
    if p.not_called:
        lines.append(f"  not called (fused into a neighbour's kernels): {', '.join(p.not_called)}")
    for c in p.choices:
        forms = " ".join(f"{form} {us:g}" for form, us in c["timings_us"].items())
        lines.append(f"  {c['kind']} {c['module']}: {c['chosen']} (us: {forms})")
    return "\n".join(lines)
