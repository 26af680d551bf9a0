"""Which form each float32 GEMM shape runs in (policy; ``matmul.py``'s kernel is the mechanism), and the residual
units' 1x1 conv as one GEMM over channels-last rows.

Rules:
- ``MatmulChoice``: cuBLAS, or ``matmul.py``'s 3xTF32 kernel in one of ``matmul.CONFIGS``' tile shapes, measured once
  per shape on the device as ``conv_choice.ConvChoice`` measures convs (same timing, same caps: not inside a
  capture, not past ``MAX_MEASURED_SHAPES``, not once a server stopped measuring: cuBLAS then), the fastest
  kept. The measurement writes into a scratch copy of ``out``, never into the caller's tensor.
- The kernel is a candidate for float32 CUDA tensors only, where the family switched its kernels on
  (``conv_choice.switch_kernels``) and autograd is off, and not under ``torch.compile``; everything else is cuBLAS.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .conv_choice import MAX_MEASURED_SHAPES, KernelChoice, choices_under, min_device_ms
from .matmul import CONFIGS

log = logging.getLogger(__name__)


def cublas(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, accumulate: bool) -> None:
    """The same through PyTorch (cuBLAS on CUDA), written into ``out``."""
    if accumulate:
        out.addmm_(a, b)  # [M, N]
        if bias is not None:
            out.add_(bias.repeat(b.shape[1] // bias.numel()))
    elif bias is None:
        torch.mm(a, b, out=out)  # [M, N]
    else:
        torch.addmm(bias.repeat(b.shape[1] // bias.numel()), a, b, out=out)  # [M, N]


class MatmulChoice(KernelChoice):
    """For one GEMM of a module: the form each shape runs in (``"cublas"`` or ``"x3_<i>"`` for the kernel in
    ``CONFIGS[i]``), measured on first sight (the module docstring)."""

    def __init__(self) -> None:
        self.decisions: dict[tuple, str] = {}
        self.timings_ms: dict[tuple, dict[str, float]] = {}

    def offers_kernel(self, t: Tensor) -> bool:
        """Whether the kernel may be measured for ``t``'s GEMM (float32 on CUDA, kernels on, autograd off, not
        under ``torch.compile``)."""
        return (t.is_cuda and t.dtype == torch.float32 and self.kernels_allowed()
                and not torch.compiler.is_compiling())

    def __call__(self, out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None = None,
                 accumulate: bool = False) -> Tensor:
        """``out`` ``[M, N]`` after ``out = a @ b (+ bias) (+ out when accumulate)``."""
        if not self.offers_kernel(a):
            cublas(out, a, b, bias, accumulate)
            return out
        key = (tuple(a.shape), b.shape[1], a.stride(), b.stride(), out.stride(), a.device, bias is not None,
               accumulate)
        form = self.decisions.get(key)
        if form is None:
            forms = ["cublas"] + [f"x3_{i}" for i, c in enumerate(CONFIGS) if c.block_n <= 2 * b.shape[1]]
            if not self.measure_new or torch.cuda.is_current_stream_capturing() or \
                    len(self.decisions) >= MAX_MEASURED_SHAPES:
                form = "cublas"  # not timed once serving (stop_measuring), inside a capture, nor past the cap
            else:
                form = self.measure(key, forms, out, a, b, bias, accumulate)
        self.run(form, out, a, b, bias, accumulate)
        return out

    def run(self, form: str, out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None, accumulate: bool) -> None:
        if form == "cublas":
            cublas(out, a, b, bias, accumulate)
            return
        torch.ops.code2wav.mm_3xtf32_(out, a, b, bias, accumulate, list(CONFIGS[int(form[3:])]))

    def measure(self, key: tuple, forms: list[str], out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None,
                accumulate: bool) -> str:
        scratch = out.clone()  # the timed calls write here, not into the caller's tensor
        timings: dict[str, float] = {}
        with torch.cuda.device(a.device):
            for form in forms:
                try:
                    timings[form] = min_device_ms(lambda t, f=form: self.run(f, scratch, t, b, bias, accumulate), a)
                except Exception as exc:  # noqa: BLE001  (cuBLAS, the first form, has no fallback: re-raised)
                    if form == "cublas":
                        raise
                    log.warning("matmul %s @ %s: form %s failed (%s: %s); left out", tuple(a.shape),
                                tuple(b.shape), form, type(exc).__name__, exc)
        best = min(timings, key=timings.get)
        self.timings_ms[key] = timings
        self.decisions[key] = best
        log.debug("matmul %s @ %s: %s -> %s", tuple(a.shape), tuple(b.shape),
                  {f: round(ms, 3) for f, ms in timings.items()}, best)
        return best


def matmul_choices(module: torch.nn.Module) -> list[MatmulChoice]:
    """Every ``MatmulChoice`` held by a submodule of ``module`` (``conv_choice.choices_under``)."""
    return [c for _, c in choices_under(module) if isinstance(c, MatmulChoice)]


def rows(t: Tensor) -> Tensor | None:
    """``t`` ``[B, C, T]`` as ``[B T, C]`` (a view) when it is channels-last (each column's channels contiguous,
    rows one after another), else None."""
    batch, channels, num_frames = t.shape
    if t.stride(1) != 1 or (num_frames > 1 and t.stride(2) != channels) or \
            (batch > 1 and t.stride(0) != channels * num_frames):
        return None
    return t.transpose(1, 2).reshape(batch * num_frames, channels)  # [B T, C], a view


def residual_matmul_(x: Tensor, weight: Tensor, h: Tensor, choice: MatmulChoice) -> Tensor:
    """``x += weight @ h`` per row, in place (a residual unit's 1x1 conv with its residual): ``x``, ``h``
    ``[B, C, T]``, ``weight`` ``[C, C]``. Channels-last float32 CUDA tensors go through ``choice`` as one
    ``[B T, C] @ [C, C]`` GEMM; otherwise one ``baddbmm``."""
    x_rows, h_rows = (rows(x), rows(h)) if choice.offers_kernel(x) else (None, None)
    if x_rows is None or h_rows is None:
        return torch.baddbmm(x, weight.expand(x.shape[0], -1, -1), h, out=x)  # [B, C, T] (stride 0 over B)
    choice(x_rows, h_rows, weight.t(), None, accumulate=True)  # [B T, C] += [B T, C] @ [C, C]
    return x
