"""The forms a dense stride-1 conv can run in (mechanism; ``conv_choice.ConvChoice`` picks one per shape).

- ``"cudnn"``: the module's own call (PyTorch's cuDNN, channels-first).
- ``"cudnn_cl"``: ``conv2d`` over ``[B, C, 1, L]`` channels-last, so cuDNN's NHWC kernels run without the layout
  conversions it wraps around a channels-first call.
- ``"polyphase"`` (dilated convs): one undilated conv over the input's phases (``dilated.py``).
- ``"gemm<i>"``: ``conv_gemm.py``'s implicit-GEMM Triton kernel over a channels-first input, tile ``CONFIGS[i]``.
- ``"gemm_cl<i>"``: ``conv_gemm_cl.py``'s implicit GEMM over a channels-last input (pipelined loads, Hopper tiles).
- ``"gemm_tma<i>"`` (compute capability 9 and later): ``conv_gemm_tma.py``'s, its tiles loaded by TMA, the output
  channels of a tile in two parts (96 or 192 channels without padding).
- ``"im2col"``: one cuBLAS GEMM over an im2col copy (``conv_im2col.py``), where the copy is small.
- ``"unit_tma<i>"`` (a residual unit's conv1 asked with its ``residual``; compute capability 9 and later, 96 or 192
  channels): ``unit_tma.py``'s kernel, the conv, its Snake, the unit's 1x1 conv and the residual in one.

Rules: each form returns ``conv(x)`` ``[B, C_out, T]`` (without its bias when asked: a caller that adds it later),
or with ``act`` a Snake's ``(alpha, beta, log_params)``, ``act(conv(x) + bias)``: the GEMM kernels apply it in their
epilogue, the other forms run the conv without its bias and then ``code2wav::snake_cat`` with ``in_bias`` (one
pass). With ``residual`` (``Residual``: a residual unit's 1x1 weight, its stream ``x`` and the unfused finish), each
form returns ``x`` updated in place to ``x + W2 @ act(conv(a) + bias)``: the ``unit_tma`` forms in one kernel, the
others by the finish after their output. ``READS_CHANNELS_LAST`` forms read their input channels-last (a Snake
kernel writes it so for free where the choice asks, ``ConvChoice.wants_channels_last``; another input is copied, the
copy in the form's time). Derived weights (a kernel's layout) are kept per module as ``derived.py`` says, and
dropped when no decision uses them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import conv_gemm, conv_gemm_cl, conv_gemm_tma, conv_im2col, snake, unit_tma
from .derived import DerivedTensor
from .dilated import polyphase_conv

CALLED_OPS = (snake.snake_cat, conv_gemm.conv_snake, conv_gemm_cl.conv_snake_cl, conv_gemm_tma.conv_snake_tma,
              unit_tma.unit_tail_tma)
"""The kernel ops the forms call as ``torch.ops.code2wav.*`` (importing their modules registers them)."""

FAMILIES = ("cudnn", "cudnn_cl", "polyphase", "gemm", "gemm_cl", "gemm_tma", "im2col", "unit_tma")
"""The form families (a form's name less its tile index); cuDNN is always offered."""

Act = tuple[Tensor, Tensor, bool]
"""A Snake applied after the conv: per-channel ``alpha``, ``beta`` and ``log_params`` (``snake.py``)."""

Residual = tuple[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]
"""A residual unit's rest after its conv1: ``(w2 [C, C], x [B, C, T], finish)``, ``finish(x, h)`` adding ``w2 @ h``
to ``x`` in place and returning it (the unfused way)."""


def reads_channels_last(form: str) -> bool:
    """Whether ``form`` reads its input channels-last (the caller writes it so when the choice asks)."""
    return form in ("cudnn_cl", "im2col") or form.startswith(("gemm_cl", "gemm_tma", "unit_tma"))


def weight_family(form: str) -> str:
    """Which derived weight ``form`` reads (``ConvForms.derived``), or ``""`` for the module's own."""
    if form.startswith(("gemm", "unit_tma")):
        return "tap_major"
    return {"cudnn_cl": "cl4d", "im2col": "im2col"}.get(form, "")


class ConvForms:
    """For one conv module: runs a named form, keeping each derived weight layout it needs."""

    def __init__(self) -> None:
        self.derived = {"tap_major": DerivedTensor(), "cl4d": DerivedTensor(), "im2col": DerivedTensor()}

    def offered(self, x: Tensor, conv: torch.nn.Conv1d, kernels_allowed: bool, residual: bool = False) -> list[str]:
        """The forms that can run ``conv`` on ``x`` (a CUDA tensor; ``kernels_allowed``: the Triton kernels may;
        ``residual``: asked with a residual unit's rest, so the unit forms too)."""
        grad = torch.is_grad_enabled()
        # the channels-last forms keep detached copies of the weight: where autograd is on they are not offered
        names = ["cudnn", "cudnn_cl"] if not grad else ["cudnn"]
        if conv.dilation[0] > 1:
            names.append("polyphase")
        half = x.dtype in (torch.bfloat16, torch.float16)
        if conv.groups == 1 and kernels_allowed and half:
            names += [f"gemm{i}" for i in range(len(conv_gemm.CONFIGS))]
            if conv.in_channels % 8 == 0:  # 16-byte rows: the pipelined loads' (and TMA's) alignment
                names += [f"gemm_cl{i}" for i in range(len(conv_gemm_cl.CONFIGS))]
                if (x.is_cuda and conv_gemm_tma.triton is not None  # a Triton with host TMA descriptors
                        and torch.cuda.get_device_capability(x.device)[0] >= 9):
                    names += [f"gemm_tma{i}" for i in range(len(conv_gemm_tma.CONFIGS))]
                    if residual and conv.in_channels == conv.out_channels and conv.bias is not None:
                        names += [f"unit_tma{i}" for i, config in enumerate(unit_tma.CONFIGS)
                                  if unit_tma.fits(conv.out_channels, config)]
        if not grad and conv.groups == 1 and conv_im2col.copy_nbytes(
                tuple(x.shape), conv.kernel_size[0], conv.dilation[0], x.element_size()) <= conv_im2col.MAX_COPY_NBYTES:
            names.append("im2col")
        return names

    def weight(self, family: str, conv: torch.nn.Conv1d) -> Tensor:
        make = {"tap_major": lambda: conv_gemm.kernel_weight(conv.weight),  # [C_out, C_in, K] view, tap-major
                "cl4d": lambda: conv.weight.detach().unsqueeze(2).contiguous(
                    memory_format=torch.channels_last),  # [C_out, C_in, 1, K] channels-last
                "im2col": lambda: conv_im2col.gemm_weight(conv.weight)}[family]  # [K C_in, C_out]
        return self.derived[family].get((conv.weight,), make)

    def drop_unused(self, chosen: set[str]) -> None:
        """Free the derived weights no chosen form reads."""
        used = {weight_family(f) for f in chosen}
        for family, derived in self.derived.items():
            if family not in used:
                derived.clear()

    def run(self, form: str, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool, act: Act | None,
            residual: Residual | None = None) -> Tensor:
        """``form``'s output for ``x`` (the module docstring): with ``residual``, its ``x`` updated."""
        if form.startswith("unit_tma"):
            if act is None or residual is None:
                raise ValueError(f"form {form} needs the Snake after the conv and the unit's residual")
            w2, stream, _ = residual
            alpha, beta, log_params = act
            torch.ops.code2wav.unit_tail_tma(x, self.weight("tap_major", conv), conv.bias, conv.dilation[0], alpha,
                                             beta, log_params, w2, stream, list(unit_tma.CONFIGS[int(form[8:])]))
            return stream  # [B, C, T], updated in place
        y = self._run(form, x, conv, with_bias, act)  # [B, C_out, T]
        return y if residual is None else residual[2](residual[1], y)

    def _run(self, form: str, x: Tensor, conv: torch.nn.Conv1d, with_bias: bool, act: Act | None) -> Tensor:
        d = conv.dilation[0]
        if form.startswith("gemm"):
            alpha, beta, log_params = act if act is not None else (None, None, False)
            bias = conv.bias if with_bias or act is not None else None
            weight = self.weight("tap_major", conv)
            if form.startswith("gemm_tma"):
                config = list(conv_gemm_tma.CONFIGS[int(form[8:])])
                return torch.ops.code2wav.conv_snake_tma(x, weight, bias, d, alpha, beta, log_params,
                                                         config)  # [B, C_out, T]
            if form.startswith("gemm_cl"):
                config = list(conv_gemm_cl.CONFIGS[int(form[7:])])
                return torch.ops.code2wav.conv_snake_cl(x, weight, bias, d, alpha, beta, log_params,
                                                        config)  # [B, C_out, T]
            config = list(conv_gemm.CONFIGS[int(form[4:])])
            return torch.ops.code2wav.conv_snake(x, weight, bias, d, alpha, beta, log_params, config)  # [B, C_out, T]
        bias = conv.bias if with_bias and act is None else None
        if form == "polyphase":
            y = polyphase_conv(x, conv.weight, bias, d, conv.groups)  # [B, C_out, T]
        elif form == "cudnn_cl":
            x4 = x.unsqueeze(2)  # [B, C_in, 1, L]: channels-last when x is
            if not x4.is_contiguous(memory_format=torch.channels_last):
                x4 = x4.contiguous(memory_format=torch.channels_last)
            y = F.conv2d(x4, self.weight("cl4d", conv), bias, dilation=(1, d),
                         groups=conv.groups)[:, :, 0]  # [B, C_out, T], channels-last
        elif form == "im2col":
            y = conv_im2col.im2col_conv(x, self.weight("im2col", conv), bias, conv.kernel_size[0],
                                        d)  # [B, C_out, T], channels-last
        else:
            y = conv._conv_forward(x, conv.weight, bias)  # [B, C_out, T] (the module's own call)
        if act is None:
            return y
        alpha, beta, log_params = act
        # no state: no lengths; a channels-last conv output stays channels-last (no transpose in the Snake kernel;
        # the caller, a residual unit's baddbmm, reads either layout)
        y, _ = torch.ops.code2wav.snake_cat(y, None, alpha, beta, None, log_params, conv.bias,
                                            y.stride(1) == 1 and y.shape[2] > 1)  # [B, C_out, T]
        return y
