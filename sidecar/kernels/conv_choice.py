"""Which form each conv runs in, per input shape, measured once on the device (policy; ``conv_forms.py`` holds the
forms: cuDNN as PyTorch calls it, cuDNN channels-last, the polyphase dilated conv, the two implicit-GEMM Triton
kernels, cuBLAS over an im2col copy; cuDNN's frontend graph API was measured and left out: docs/design-notes.md).

Which is fastest depends on the shape, cuDNN's version and the GPU (on the H200, PyTorch's cuDNN call picked sm80
kernels and layout conversions for several convs), so nothing is written down: ``ConvChoice`` times every offered
form once per input shape (CUDA events on the input's device, minimum of ``TIMED_ITERS`` calls after one untimed,
queued together behind a short GPU spin so that host overhead, which a captured graph does not have, stays out of the
time), keeps the fastest and logs the choice with every form's time. Graph buckets are warmed up eagerly before
capture, so their shapes are measured then, at start-up, and captured in the chosen form. A server attaches a
``ChoiceCache`` (``attach_choices``): a choice measured once on this GPU with these library versions is read back
at the next start instead of measured again.

Once a server's graphs are captured (``stop_measuring``), a new shape is not measured: it takes the form measured
for the nearest shape of the same conv (same dtype, Snake and kernels; the closest number of input columns, batch
times length), counted as source ``inferred``. Measuring one shape costs some 0.2-0.4 s per conv at large eager
shapes (every form compiled and timed), and eager steps come in ever new lengths: on an H100, a failover that
replayed 1,000 streams' histories (580 frames each, batches of many lengths) stalled each surviving sidecar's engine
for tens of seconds measuring them, until clients timed out (docs/design-notes.md).

Where no measurement may happen the conv runs cuDNN, and that fallback is logged and counted (``ChoiceEvents``,
exported as ``code2wav_sidecar_kernel_fallbacks_total``): a shape first seen inside a capture, shapes past
``MAX_MEASURED_SHAPES`` (eager steps of ever new shapes), a form that fails to compile or launch (left out). CPU
tensors, ``torch.compile`` tracing and convs with padding or a stride use cuDNN without a choice to make. A new shape
costs its first step the measurement: per conv and form one untimed call and three timed ones, behind one 1 ms
spin (up to 14 forms: some tens of milliseconds per conv, plus Triton's compile the first time a kernel variant
runs).

The Triton kernels are candidates only where the family switched its kernels on (``kernels``, set by
``switch_kernels`` from ``use_fused_kernels``; ``engine.fused_kernels: false`` keeps them out) and autograd is off
(they have no backward); the decision key records both, so a choice made with the kernels is never reused without.
With ``act`` (a Snake's ``(alpha, beta, log_params)``), each form is timed with its Snake, so the comparison is of
what the step would run.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from . import conv_gemm, snake
from .choice_cache import ChoiceCache, ChoiceEvents, geometry
from .conv_forms import Act, ConvForms, Residual, reads_channels_last

log = logging.getLogger(__name__)

TIMED_ITERS = 3
"""Timed calls per form (after one untimed): the minimum is kept."""
HEAD_START_CYCLES = 2_000_000
"""GPU clock cycles (about 1 ms) the stream spins before the timed calls, so their host-side work (cuDNN's plan
setup, Triton's launcher: tens of microseconds each, none of it in a CUDA graph) is all queued before the GPU gets
there and the events time the device alone, back to back, as a captured graph runs them. One spin per form, not
per call: start-up measures every form of every conv at every bucket shape (docs/design-notes.md)."""
MAX_MEASURED_SHAPES = 32
"""Shapes measured per conv; later new shapes (eager steps only: graph buckets are measured at start-up) keep cuDNN."""

MAX_INFERRED_SHAPES = 256
"""Inferred shapes kept per conv once measuring stopped (past it each new shape is inferred again: a few dict
lookups, no device work)."""


def nearest_form(decisions: dict[tuple, str], key: tuple) -> str | None:
    """The form decided for the measured shape nearest ``key`` (``ConvChoice.key``: ``(*shape, dtype, device,
    epilogue, kernels)``, shape ``(batch, channels, length)``): same channels, dtype, device, epilogue and kernels,
    the closest number of columns (batch x length; on a tie the larger shape). None: no such shape (pure)."""
    (batch, channels, length), rest = key[:3], key[3:]
    columns = batch * length
    best, best_distance = None, None
    for (b, c, n, *other), form in decisions.items():
        if c != channels or tuple(other) != rest:
            continue
        distance = (abs(b * n - columns), -(b * n))
        if best_distance is None or distance < best_distance:
            best, best_distance = form, distance
    return best


def plain(conv: torch.nn.Conv1d) -> bool:
    """What the other forms compute: stride 1, no padding (the causal convs pad with their state instead)."""
    return conv.stride == (1,) and conv.padding in ((0,), "valid") and conv.padding_mode == "zeros"


def min_device_ms(fn, x: Tensor) -> float:
    """Minimum device time of ``fn(x)`` on ``x``'s device and its current stream (call it under
    ``torch.cuda.device(x.device)``), host overhead excluded (``HEAD_START_CYCLES``)."""
    fn(x)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(TIMED_ITERS)]
    torch.cuda._sleep(HEAD_START_CYCLES)
    for start, end in events:
        start.record()
        fn(x)
        end.record()
    events[-1][1].synchronize()
    return min(start.elapsed_time(end) for start, end in events)


class KernelChoice:
    """A call site's choice between PyTorch's call and hand-written Triton kernels, measured per shape (``ConvChoice``
    here, ``matmul_choice.MatmulChoice``). ``kernels`` is set by ``switch_kernels`` from the family's
    ``use_fused_kernels``."""

    kernels = False
    """Whether the hand-written kernels may be measured and used."""
    measure_new = True
    """Whether a shape seen the first time is measured (start-up: the graph buckets' warm-ups). ``stop_measuring``
    turns it off once a server's graphs are captured: a serving step of a new shape (an eager step: a long chunk, a
    failover's history replay, each batch of another length) then takes the form measured for the nearest shape
    (``nearest_form``) instead of stalling the engine for the measurement of every form of every conv."""

    def kernels_allowed(self) -> bool:
        """The kernels may run now: switched on, Triton present (one install serves every kernel module), autograd
        off (they have no backward)."""
        return self.kernels and conv_gemm.triton is not None and not torch.is_grad_enabled()


class ConvChoice(KernelChoice):
    """For one conv module: the form each input shape runs in, measured on first sight (or read from the
    ``ChoiceCache`` a server attaches, ``attach_choices``).

    ``decisions`` maps ``(batch, channels, length, dtype, device, epilogue, kernels allowed)`` to a form name
    (epilogue: 0 none, 1 a Snake, 2 a Snake and a residual unit's rest; ``epilogue``)
    (``conv_forms.py``); ``timings_ms`` keeps every form's measurement for logs and the profile. A caller that can
    write the input either way asks ``wants_channels_last`` first; the other forms take it contiguous. ``name`` (the
    module's path), ``cache``, ``events`` and ``allowed`` (the form families, names less their tile index, a diagnostic
    run restricts the choice to; None: all) are set by ``attach_choices``."""

    def __init__(self) -> None:
        self.decisions: dict[tuple, str] = {}
        self.timings_ms: dict[tuple, dict[str, float]] = {}
        self.forms = ConvForms()
        self.name = "conv"
        self.cache: ChoiceCache | None = None
        self.events: ChoiceEvents = ChoiceEvents()
        self.allowed: tuple[str, ...] | None = None

    def key(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, with_act: int) -> tuple:
        return (*shape, dtype, device, int(with_act), self.kernels_allowed())

    def wants_channels_last(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                            with_act: int) -> bool:
        """Whether the form chosen for an input of ``shape`` reads it channels-last (False until measured)."""
        key = self.key(shape, dtype, device, with_act)
        form = self.decisions.get(key)
        if form is None and not self.measure_new:
            form = nearest_form(self.measured(), key)
        return form is not None and reads_channels_last(form)

    def __call__(self, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool = True, act: Act | None = None,
                 channels_last_ok: bool = False, residual: Residual | None = None) -> Tensor:
        """``conv(x)`` ``[B, C_out, T]`` (without its bias when ``with_bias`` is False: a caller that adds it later),
        or with ``act``, ``act(conv(x) + bias)``. ``channels_last_ok``: the caller writes ``x`` channels-last for
        free when ``wants_channels_last`` says so (then the channels-last forms are timed on such an input; else on
        ``x`` as it comes, the copy included). ``residual`` (with ``act``: a residual unit's conv1): return the unit's
        stream updated in place, ``x + W2 @ act(conv(x) + bias)`` (``conv_forms.Residual``)."""
        if not x.is_cuda or torch.compiler.is_compiling() or not plain(conv):
            return self.forms.run("cudnn", x, conv, with_bias, act, residual)
        key = self.key(tuple(x.shape), x.dtype, x.device, epilogue(act, residual))
        form = self.decisions.get(key)
        if form is None:
            form = self.decide(key, x, conv, with_bias, act, channels_last_ok, residual)
        return self.forms.run(form, x, conv, with_bias, act, residual)

    def run(self, form: str, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool, act: Act | None,
            residual: Residual | None = None) -> Tensor:
        """``form``'s output (``ConvForms.run``), whatever was decided."""
        return self.forms.run(form, x, conv, with_bias, act, residual)

    def offered(self, x: Tensor, conv: torch.nn.Conv1d, residual: bool = False) -> list[str]:
        """The forms that can run ``conv`` on ``x``, less those ``allowed`` leaves out (cuDNN always stays)."""
        names = self.forms.offered(x, conv, self.kernels_allowed(), residual)
        if self.allowed is not None:
            names = [n for n in names if n == "cudnn" or n.rstrip("0123456789") in self.allowed]
        return names

    def decide(self, key: tuple, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool, act: Act | None,
               channels_last_ok: bool, residual: Residual | None = None) -> str:
        """The form for a shape seen the first time: cached, measured, or cuDNN where neither may happen (counted)."""
        forms = self.offered(x, conv, residual is not None)
        cached = self.cache.lookup(self.name, geometry(conv), key) if self.cache is not None else None
        if cached is not None and cached[0] in forms:
            self.decisions[key], self.timings_ms[key] = cached
            self.events.decided(cached[0], "cache")
            return cached[0]
        if len(forms) == 1:
            return "cudnn"  # nothing to choose
        if not self.measure_new:
            return self.infer(key, forms)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or len(self.decisions) >= MAX_MEASURED_SHAPES:
            reason = "in_capture" if capturing else "past_shape_cap"
            log.warning("conv %s %s: cuDNN without measuring (%s)", self.name, tuple(x.shape), reason)
            self.events.fell_back(reason)
            if not capturing:
                self.decisions[key] = "cudnn"  # past the cap: said and counted once per shape
            return "cudnn"
        form = self.measure(key, forms, x, conv, with_bias, act, channels_last_ok, residual)
        if self.cache is not None:
            self.cache.store(self.name, geometry(conv), key, form, self.timings_ms[key])
        return form

    def measured(self) -> dict[tuple, str]:
        """The decisions measured (or read from the cache), not inferred."""
        return {key: self.decisions[key] for key in self.timings_ms}

    def infer(self, key: tuple, forms: list[str]) -> str:
        """A new shape once measuring stopped: the nearest measured shape's form where it can run this one (else
        cuDNN channels-last, else cuDNN), kept (up to ``MAX_MEASURED_SHAPES`` shapes) and counted."""
        form = nearest_form(self.measured(), key)
        if form not in forms:
            form = "cudnn_cl" if "cudnn_cl" in forms else "cudnn"
        if len(self.decisions) < MAX_MEASURED_SHAPES + MAX_INFERRED_SHAPES:
            self.decisions[key] = form
        self.events.decided(form, "inferred")
        return form

    def measure(self, key: tuple, forms: list[str], x: Tensor, conv: torch.nn.Conv1d, with_bias: bool,
                act: Act | None, channels_last_ok: bool = False, residual: Residual | None = None) -> str:
        timings: dict[str, float] = {}
        if residual is not None:  # every form adds into the unit's stream: time them on a scratch copy of it
            residual = (residual[0], residual[1].clone(), residual[2])
        # as it would come: channels-last where the caller writes it so (else a channels-last form's time has the
        # copy in it)
        x_cl = x.transpose(1, 2).contiguous().transpose(1, 2) if channels_last_ok else x  # [B, C_in, L]
        with torch.cuda.device(x.device):  # events on x's device (a server may run on cuda:N)
            for form in forms:
                try:
                    timings[form] = min_device_ms(lambda t, f=form: self.forms.run(f, t, conv, with_bias, act,
                                                                                   residual),
                                                  x_cl if reads_channels_last(form) else x)
                except Exception as exc:  # noqa: BLE001  (cuDNN, the first form, has no fallback: re-raised)
                    if form == "cudnn":
                        raise
                    log.warning("conv %s %s: form %s failed (%s: %s); left out", self.name, tuple(x.shape), form,
                                type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                    self.events.fell_back(f"{form.rstrip('0123456789')}_failed")
        best = min(timings, key=timings.get)
        self.timings_ms[key] = timings
        self.decisions[key] = best
        self.forms.drop_unused(set(self.decisions.values()))  # measured, not used: no second copy of the weight
        self.events.decided(best, "measured")
        ranked = sorted(timings.items(), key=lambda kv: kv[1])
        log.info("conv %s %s %s: %s (%s)", self.name, tuple(x.shape), str(x.dtype).replace("torch.", ""), best,
                 ", ".join(f"{f} {ms * 1e3:.0f} us" for f, ms in ranked))
        return best


def epilogue(act: object | None, residual: Residual | None) -> int:
    """A decision key's epilogue: 0 the conv alone, 1 with the Snake after it (``act``: its parameters or module), 2
    with the Snake and a residual unit's rest (``ConvChoice.__call__``'s ``residual``). Pure."""
    return 2 if residual is not None else int(act is not None)


def held_choices(obj: object, depth: int = 1):
    """The ``KernelChoice``s among ``obj``'s attributes, and among those of its plain helper objects (not modules:
    ``module.modules()`` reaches those) ``depth`` levels down (a transposed conv's ``SnakeThenTransposedConv``)."""
    for value in vars(obj).values():
        if isinstance(value, KernelChoice):
            yield value
        elif depth and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, Tensor, type)):
            yield from held_choices(value, depth - 1)


def choices_under(module: torch.nn.Module):
    """``(module path, choice)`` for every ``KernelChoice`` a submodule of ``module`` holds (``held_choices``)."""
    for where, sub in module.named_modules():
        for choice in held_choices(sub):
            yield where, choice


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


def stop_measuring(module: torch.nn.Module) -> int:
    """Every ``KernelChoice`` under ``module`` stops measuring new shapes (``KernelChoice.measure_new``): a server
    calls it once its graph buckets are captured. Returns how many it reached."""
    choices = [choice for _, choice in choices_under(module)]
    for choice in choices:
        choice.measure_new = False
    return len(choices)


def attach_choices(module: torch.nn.Module, cache: ChoiceCache | None, events: ChoiceEvents,
                   allowed: tuple[str, ...] | None = None) -> int:
    """Name every ``ConvChoice`` under ``module`` by its module's path and give it ``cache`` (None: measure at every
    start), ``events`` (the fallback and decision counts a server exports) and ``allowed`` (form families, e.g.
    ``("cudnn_cl", "gemm")``, a diagnostic run restricts the choice to: the profile's before/after). Returns how
    many it reached."""
    count = 0
    for where, choice in choices_under(module):
        if isinstance(choice, ConvChoice):
            choice.name, choice.cache, choice.events, choice.allowed = where or "conv", cache, events, allowed
            count += 1
    return count
