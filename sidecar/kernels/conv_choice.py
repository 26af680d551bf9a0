"""Which form each conv runs in, per input shape, measured once on the device (policy; the forms are mechanism).

A dense stride-1 conv of the decoders can run four ways: cuDNN as PyTorch calls it, cuDNN on channels-last tensors
(``"cudnn_cl"``: ``conv2d`` over ``[B, C, 1, L]`` with the channels contiguous in the input, the weight and the
output, so cuDNN's NHWC kernels run without the layout conversions it wraps around an NCHW call: 30 of the 385
kernels of a batch-1 step; where the caller writes its input channels-last at no cost, ``channels_last_ok``, it is
timed on such an input, elsewhere on the input as it comes, its copy to channels-last included),
``dilated.polyphase_conv`` (a dilated conv as one undilated conv over its input's phases) and ``conv_gemm``'s
implicit-GEMM Triton kernel (bf16/fp16 only; several tile shapes, ``conv_gemm.CONFIGS``). Which is
fastest depends on the shape, cuDNN's version and the GPU (on the H200, cuDNN picked a kernel without tensor cores
for one dilated conv, and wraps the others in layout conversions), so nothing is written down: ``ConvChoice`` times
every form once per input shape (CUDA events on the input's device, minimum of ``TIMED_ITERS`` calls after one
untimed, each queued behind a short GPU spin so that host overhead, which a captured graph does not have, stays out
of the time) and keeps the fastest. Graph buckets are warmed up eagerly before capture, so their shapes are measured
then and captured in the chosen form. CPU tensors, shapes first seen during a capture, ``torch.compile`` tracing,
convs with padding or a stride, and shapes past ``MAX_MEASURED_SHAPES`` (eager steps of ever new shapes) use cuDNN.
A new shape costs its first step the measurement: per conv and form one untimed call and three timed ones, each
behind a 1 ms spin, so for a whole step of the 12 Hz codes decoder (14 dense convs, up to 7 forms) on the order of
0.2-0.3 s, more at batch 64, plus Triton's compile the first time a kernel variant runs. Graph buckets pay it at
start-up; an eager step of a new shape pays it once. A form that fails (a kernel that does not compile or launch on
this GPU) is logged and left out.

The GEMM kernel is a candidate only where the family switched its kernels on (``kernels``, set by
``switch_kernels`` from ``use_fused_kernels``; ``engine.fused_kernels: false`` keeps it out) and autograd is off (it
has no backward); the decision key records both, so a choice made with the kernel is never reused without it.

With ``act`` (a Snake's ``(alpha, beta, log_params)``), the call returns ``act(conv(x) + bias)``: the GEMM kernel
applies it in its epilogue, the other forms run the conv without its bias and then ``code2wav::snake_cat`` with
``in_bias`` (one pass); each form is timed with its Snake, so the comparison is of what the step would run.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from . import conv_gemm, snake  # noqa: F401  (snake registers torch.ops.code2wav.snake_cat)
from .derived import DerivedTensor
from .dilated import polyphase_conv

log = logging.getLogger(__name__)

TIMED_ITERS = 3
"""Timed calls per form (after one untimed): the minimum is kept."""
HEAD_START_CYCLES = 2_000_000
"""GPU clock cycles (about 1 ms) the stream spins before each timed call, so the call's host-side work (cuDNN's
plan setup, Triton's launcher: tens of microseconds, none of it in a CUDA graph) is queued before the GPU gets
there and the events time the device alone, as a captured graph runs it."""
MAX_MEASURED_SHAPES = 32
"""Shapes measured per conv; later new shapes (eager steps only: graph buckets are measured at start-up) keep cuDNN."""

Act = tuple[Tensor, Tensor, bool]
"""A Snake applied after the conv: per-channel ``alpha``, ``beta`` and ``log_params`` (``snake.py``)."""


def plain(conv: torch.nn.Conv1d) -> bool:
    """What the other forms compute: stride 1, no padding (the causal convs pad with their state instead)."""
    return conv.stride == (1,) and conv.padding in ((0,), "valid") and conv.padding_mode == "zeros"


def min_device_ms(fn, x: Tensor) -> float:
    """Minimum device time of ``fn(x)`` on ``x``'s device and its current stream (call it under
    ``torch.cuda.device(x.device)``), host overhead excluded (``HEAD_START_CYCLES``)."""
    fn(x)
    times = []
    for _ in range(TIMED_ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HEAD_START_CYCLES)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


class KernelChoice:
    """A call site's choice between PyTorch's call and hand-written Triton kernels, measured per shape (``ConvChoice``
    here, ``matmul_choice.MatmulChoice``). ``kernels`` is set by ``switch_kernels`` from the family's
    ``use_fused_kernels``."""

    kernels = False
    """Whether the hand-written kernels may be measured and used."""

    def kernels_allowed(self) -> bool:
        """The kernels may run now: switched on, Triton present (one install serves every kernel module), autograd
        off (they have no backward)."""
        return self.kernels and conv_gemm.triton is not None and not torch.is_grad_enabled()


class ConvChoice(KernelChoice):
    """For one conv module: the form each input shape runs in, measured on first sight.

    ``decisions`` maps ``(batch, channels, length, dtype, device, with Snake, kernels allowed)`` to a form name
    (``"cudnn"``, ``"cudnn_cl"``, ``"polyphase"``, ``"gemm<i>"`` for ``conv_gemm.CONFIGS[i]``); ``timings_ms``
    keeps every form's measurement for logs and probes. A caller that can write the input either way asks
    ``wants_channels_last`` first; the other forms take it contiguous."""

    def __init__(self) -> None:
        self.decisions: dict[tuple, str] = {}
        self.timings_ms: dict[tuple, dict[str, float]] = {}
        self._gemm_weight: DerivedTensor[Tensor] = DerivedTensor()  # the tap-major copy of the weight
        self._cl_weight: DerivedTensor[Tensor] = DerivedTensor()  # [C_out, C_in, 1, K] channels-last

    def key(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, with_act: bool) -> tuple:
        return (*shape, dtype, device, with_act, self.kernels_allowed())

    def wants_channels_last(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                            with_act: bool) -> bool:
        """Whether the form chosen for an input of ``shape`` reads it channels-last (False until measured)."""
        return self.decisions.get(self.key(shape, dtype, device, with_act)) == "cudnn_cl"

    def __call__(self, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool = True, act: Act | None = None,
                 channels_last_ok: bool = False) -> Tensor:
        """``conv(x)`` ``[B, C_out, T]`` (without its bias when ``with_bias`` is False: a caller that adds it later),
        or with ``act``, ``act(conv(x) + bias)``. ``channels_last_ok``: the caller writes ``x`` channels-last for
        free when ``wants_channels_last`` says so (then ``"cudnn_cl"`` is timed on such an input; else on ``x`` as
        it comes, the copy included)."""
        if not x.is_cuda or torch.compiler.is_compiling() or not plain(conv):
            return self.run("cudnn", x, conv, with_bias, act)
        key = self.key(tuple(x.shape), x.dtype, x.device, act is not None)
        form = self.decisions.get(key)
        if form is None:
            forms = self.forms(x, conv)
            if len(forms) == 1 or torch.cuda.is_current_stream_capturing() or \
                    len(self.decisions) >= MAX_MEASURED_SHAPES:
                form = "cudnn"  # nothing to choose, not timed inside a capture, nor past the cap
            else:
                form = self.measure(key, forms, x, conv, with_bias, act, channels_last_ok)
        return self.run(form, x, conv, with_bias, act)

    def forms(self, x: Tensor, conv: torch.nn.Conv1d) -> list[str]:
        """The forms that can run ``conv`` on ``x``."""
        # cudnn_cl keeps a detached channels-last copy of the weight: where autograd is on it is not offered. A
        # caller that cannot write x channels-last gets it too, with the copy to channels-last in its time
        names = ["cudnn", "cudnn_cl"] if not torch.is_grad_enabled() else ["cudnn"]
        if conv.dilation[0] > 1:
            names.append("polyphase")
        if conv.groups == 1 and self.kernels_allowed() and x.dtype in (torch.bfloat16, torch.float16):
            names += [f"gemm{i}" for i in range(len(conv_gemm.CONFIGS))]
        return names

    def run(self, form: str, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool, act: Act | None) -> Tensor:
        """``form``'s output for ``x`` (see ``__call__``)."""
        d = conv.dilation[0]
        if form.startswith("gemm"):
            alpha, beta, log_params = act if act is not None else (None, None, False)
            config = list(conv_gemm.CONFIGS[int(form[4:])])
            bias = conv.bias if with_bias or act is not None else None
            return torch.ops.code2wav.conv_snake(x, self.gemm_weight(conv), bias, d, alpha, beta, log_params,
                                                 config)  # [B, C_out, T]
        bias = conv.bias if with_bias and act is None else None
        if form == "polyphase":
            y = polyphase_conv(x, conv.weight, bias, d, conv.groups)  # [B, C_out, T]
        elif form == "cudnn_cl":
            x4 = x.unsqueeze(2)  # [B, C_in, 1, L]: channels-last when x is
            if not x4.is_contiguous(memory_format=torch.channels_last):
                x4 = x4.contiguous(memory_format=torch.channels_last)
            weight = self._cl_weight.get((conv.weight,), lambda: conv.weight.detach().unsqueeze(2).contiguous(
                memory_format=torch.channels_last))  # [C_out, C_in, 1, K]
            y = F.conv2d(x4, weight, bias, dilation=(1, d), groups=conv.groups)[:, :, 0]  # [B, C_out, T], channels-last
        else:
            y = conv._conv_forward(x, conv.weight, bias)  # [B, C_out, T] (the module's own call)
        if act is None:
            return y
        alpha, beta, log_params = act
        # no state: no lengths; a channels-last conv output stays channels-last (no transpose in the Snake kernel;
        # the caller, a residual unit's baddbmm, reads either layout)
        y, _ = torch.ops.code2wav.snake_cat(y, None, alpha, beta, None, log_params, conv.bias,
                                            form == "cudnn_cl")  # [B, C_out, T]
        return y

    def gemm_weight(self, conv: torch.nn.Conv1d) -> Tensor:
        """The conv's weight laid out tap-major for the GEMM kernel (``conv_gemm.kernel_weight``), kept as
        ``kernels/derived.py`` says. Dropped again after a measurement if no decision uses the kernel."""
        return self._gemm_weight.get((conv.weight,), lambda: conv_gemm.kernel_weight(conv.weight))

    def measure(self, key: tuple, forms: list[str], x: Tensor, conv: torch.nn.Conv1d, with_bias: bool,
                act: Act | None, channels_last_ok: bool = False) -> str:
        timings: dict[str, float] = {}
        # as it would come: channels-last where the caller writes it so (else cudnn_cl's time has the copy in it)
        x_cl = x.transpose(1, 2).contiguous().transpose(1, 2) if "cudnn_cl" in forms and channels_last_ok else x
        with torch.cuda.device(x.device):  # events on x's device (a server may run on cuda:N)
            for form in forms:
                try:
                    timings[form] = min_device_ms(lambda t, f=form: self.run(f, t, conv, with_bias, act),
                                            x_cl if form == "cudnn_cl" else x)
                except Exception as exc:  # noqa: BLE001  (cuDNN, the first form, has no fallback: re-raised)
                    if form == "cudnn":
                        raise
                    log.warning("conv %s: form %s failed (%s: %s); left out", tuple(x.shape), form,
                                type(exc).__name__, exc)
        best = min(timings, key=timings.get)
        self.timings_ms[key] = timings
        self.decisions[key] = best
        if not any(f.startswith("gemm") for f in self.decisions.values()):
            self._gemm_weight.clear()  # measured, not used: no second copy of the weight
        if "cudnn_cl" not in self.decisions.values():
            self._cl_weight.clear()
        log.debug("conv %s: %s -> %s", tuple(x.shape), {f: round(ms, 3) for f, ms in timings.items()}, best)
        return best


def held_choices(obj: object, depth: int = 1):
    """The ``KernelChoice``s among ``obj``'s attributes, and among those of its plain helper objects (not modules:
    ``module.modules()`` reaches those) ``depth`` levels down (a transposed conv's ``SnakeThenTransposedConv``)."""
    for value in vars(obj).values():
        if isinstance(value, KernelChoice):
            yield value
        elif depth and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, Tensor, type)):
            yield from held_choices(value, depth - 1)


def switch_kernels(module: torch.nn.Module, activation: type, enabled: bool) -> bool:
    """Every hand-written kernel under ``module`` on or off (a family's ``use_fused_kernels``): the Snake kernels on
    the family's ``activation`` modules (``snake.set_fused``) and, as they are, every ``KernelChoice`` a submodule
    holds (``held_choices``) and ``kernels_on`` on every submodule that has it (a block that calls a kernel op
    itself, such as a transformer's rotary op). Returns whether the kernels are in use (False without Triton)."""
    fused = snake.set_fused(module, activation, enabled)
    for sub in module.modules():
        for choice in held_choices(sub):
            choice.kernels = fused
        if hasattr(sub, "kernels_on"):
            sub.kernels_on = fused
    return fused
