"""A causal transposed conv of kernel ``2s`` and stride ``s``, with the Snake before it, as one GEMM.

Both families upsample with ``ConvTranspose1d(C_in, C_out, 2s, stride s)`` run over ``[prev, act(x)]`` (the last
input frame of the chunk before, then the chunk) and keep the middle ``L * s`` samples. Output sample ``t * s + r``
of the chunk (``t < L``, ``r < s``) is

    ``y[o, t s + r] = sum_c W[c, o, s + r] cat[c, t] + W[c, o, r] cat[c, t + 1]``

(each output frame sees two input frames, so the state is one frame). Run by cuDNN, PyTorch's transposed conv is a
backward-data conv: on the H200 an sm75 ``cutlass`` kernel with alignment 1 in bf16 (1.73 ms of a 13.5 ms step at
batch 16 x 25 frames, the default model) and a generic ``dgrad_engine`` in float32 (280 of 711 us of the 48 kHz
family's 1 x 4-frame step; ``code2wav-sidecar profile``). Here:

- ``snake_pairs`` (``code2wav::snake_pairs``) applies the Snake and writes each frame pair once, time-major:
  ``pairs[b, t] = [cat[:, t], cat[:, t + 1]]`` ``[B, L, 2 C_in]`` (``snake.py``'s tiled kernel; the state frame
  in front and the new tail as ``snake_cat`` has them);
- ``conv`` multiplies ``[B * L, 2 C_in] @ [2 C_in, s C_out]`` (``pair_weight``: row ``j C_in + c`` is tap
  ``(1 - j) s + r`` of input channel ``c``, column ``r C_out + o``) in one cuBLAS GEMM, one rounding, and the
  result ``[B, L, s, C_out]`` is the output ``[B, C_out, L s]`` channels-last: each sample's channels contiguous
  (strides ``(L s C_out, 1, C_out)``). The kernels after it (``snake.py``'s, ``snake_conv.py``'s, the residual
  units' ``baddbmm``) read and write either layout; the residual stream of a decoder block stays channels-last.

``SnakeThenTransposedConv`` runs both, as both families' transposed-conv blocks call it.

The pairs write each activated input frame twice: the input of an upsampling conv has ``C_in = 2 C_out`` channels at
``1 / s`` of the output's rate, so the pairs are ``4 / s`` of the output's size (``s`` 2..8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import snake
from .derived import DerivedTensor
from .matmul_choice import MatmulChoice


def pair_weight(weight: Tensor, stride: int) -> Tensor:
    """``[2 C_in, s C_out]`` from a ``ConvTranspose1d`` weight ``[C_in, C_out, 2s]``: rows ``0..C_in`` take the older
    frame of a pair (taps ``s..2s-1``), rows ``C_in..2 C_in`` the newer (taps ``0..s-1``); column ``r C_out + o``."""
    c_in, c_out, ksize = weight.shape
    if ksize != 2 * stride:
        raise ValueError(f"pair_weight needs kernel size 2 * stride, got kernel {ksize} and stride {stride}")
    taps = weight.detach().permute(0, 2, 1)  # [C_in, 2s, C_out]
    older = taps[:, stride:].reshape(c_in, stride * c_out)  # [C_in, s C_out]
    newer = taps[:, :stride].reshape(c_in, stride * c_out)  # [C_in, s C_out]
    return torch.cat([older, newer], dim=0).contiguous()  # [2 C_in, s C_out]


def conv(pairs: Tensor, weight_pairs: Tensor, bias: Tensor | None, stride: int,
         choice: MatmulChoice | None = None) -> Tensor:
    """The transposed conv's chunk output ``[B, C_out, L s]`` (channels-last strides) from ``pairs``
    ``[B, L, 2 C_in]`` and ``pair_weight``'s ``[2 C_in, s C_out]``; ``bias`` ``[C_out]`` or None (a caller that adds
    it later). ``choice``: the GEMM's form (float32 on CUDA: cuBLAS or ``matmul.py``'s 3xTF32 kernel); None: cuBLAS."""
    batch, num_frames, _ = pairs.shape
    rows = pairs.reshape(batch * num_frames, pairs.shape[2])  # [B L, 2 C_in]
    if choice is not None and choice.offers_kernel(rows):
        y = choice(rows.new_empty(rows.shape[0], weight_pairs.shape[1]), rows, weight_pairs, bias)  # [B L, s C_out]
    elif bias is None:
        y = torch.mm(rows, weight_pairs)  # [B L, s C_out]
    else:
        y = torch.addmm(bias.repeat(stride), rows, weight_pairs)  # [B L, s C_out]
    c_out = weight_pairs.shape[1] // stride
    return y.view(batch, num_frames * stride, c_out).transpose(1, 2)  # [B, C_out, L s]


def frame_weight(weight: Tensor) -> Tensor:
    """``[s C_out, C_in]`` from a ``ConvTranspose1d`` weight ``[C_in, C_out, s]`` of kernel ``s`` (= its stride): row
    ``r C_out + o`` is tap ``r`` of output channel ``o`` (``F.linear``'s weight layout)."""
    c_in, c_out, ksize = weight.shape
    return weight.detach().permute(2, 1, 0).reshape(ksize * c_out, c_in).contiguous()  # [s C_out, C_in]


class FrameTransposedConv:
    """A transposed conv whose kernel equals its stride ``s`` (an upsampling stage with no overlap between frames):
    output frame ``t`` sees input frame ``t`` alone, so there is no state and the conv is one ``F.linear``:
    ``[B, T, C_in] @ [C_in, s C_out]`` plus the bias (cuBLAS's epilogue), whose output ``[B, T, s, C_out]`` is
    ``[B, C_out, T s]`` channels-last. cuDNN runs it as a backward-data conv wrapped in layout conversions of its
    input, weight and output. The weight's copy is kept as ``derived.py`` says; for that, callers run it only where
    ``derived.kernel_forms()``."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self._weight: DerivedTensor[Tensor] = DerivedTensor()
        self._bias: DerivedTensor[Tensor] = DerivedTensor()

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``y`` ``[B, C_out, T s]`` (channels-last) for ``x`` ``[B, C_in, T]`` (any strides; channels-last is read
        without a copy), ``weight`` ``[C_in, C_out, s]``."""
        batch, _, num_frames = x.shape
        frames = self._weight.get((weight,), lambda: frame_weight(weight))  # [s C_out, C_in]
        c_out = frames.shape[0] // self.stride
        # [s C_out]: column r C_out + o is bias[o] (made once, as the weight's copy)
        full_bias = None if bias is None else self._bias.get((bias,), lambda: bias.detach().repeat(self.stride))
        y = F.linear(x.transpose(1, 2), frames, full_bias)  # [B, T, s C_out]
        return y.reshape(batch, num_frames * self.stride, c_out).transpose(1, 2)  # [B, C_out, T s]


class SnakeThenTransposedConv:
    """What a family's transposed-conv block runs where its Snake runs fused: ``snake_pairs``, then ``conv`` with
    the block's weight as ``pair_weight`` (kept as ``derived.py`` says)."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self._weight: DerivedTensor[Tensor] = DerivedTensor()
        self.choice = MatmulChoice()  # the GEMM's form (``conv_choice.switch_kernels`` reaches it through the owning module)

    def __call__(self, x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
                 weight: Tensor, bias: Tensor | None, in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(y [B, C_out, T s] channels-last, tail [B, C_in, 1])`` for ``x`` ``[B, C_in, T]`` and the one-frame
        ``state``; ``weight`` ``[C_in, C_out, 2s]``, ``bias`` ``[C_out]`` or None (a caller that adds it later),
        ``in_bias`` as for ``snake_pairs``."""
        pairs, tail = torch.ops.code2wav.snake_pairs(x, state, alpha, beta, lengths, log_params,
                                                     in_bias)  # [B, T, 2 C_in], [B, C_in, 1]
        weight_pairs = self._weight.get((weight,), lambda: pair_weight(weight, self.stride))  # [2 C_in, s C_out]
        return conv(pairs, weight_pairs, bias, self.stride, self.choice), tail


def reference(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
              in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``snake_pairs``' torch expression (CPU and meta implementation, what the kernel is tested against)."""
    if in_bias is not None:
        x = x + in_bias[None, :, None]  # [B, C, T]
    cat, tail = snake.reference(x, state, alpha, beta, lengths, log_params)  # [B, C, 1 + T], [B, C, 1]
    pairs = torch.cat([cat[:, :, :-1], cat[:, :, 1:]], dim=1)  # [B, 2C, T]
    return pairs.transpose(1, 2).contiguous(), tail.contiguous()  # [B, T, 2C]


def _check(x: Tensor, state: Tensor) -> None:
    if state.dim() != 3 or state.shape[:2] != x.shape[:2] or state.shape[2] != 1:
        raise ValueError(f"snake_pairs needs a one-frame state [B, C, 1] for x {tuple(x.shape)}, got "
                         f"{tuple(state.shape)}")


@torch.library.custom_op("code2wav::snake_pairs", mutates_args=())
def snake_pairs(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
                in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(pairs [B, T, 2C], tail [B, C, 1])``: Snake of ``x + in_bias`` (``x`` ``[B, C, T]``, any strides) after the
    one-frame ``state``, written as frame pairs (the module docstring); ``tail`` is the frame that ends at each
    row's ``lengths`` (``snake_cat``'s)."""
    _check(x, state)
    if x.is_cuda and snake.triton is not None:
        return snake._launch(x, state.to(x.dtype), alpha, beta, lengths, log_params, in_bias, pairs=True)
    return reference(x, state, alpha, beta, lengths, log_params, in_bias)


@snake_pairs.register_fake
def _(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
      in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    _check(x, state)
    return x.new_empty((x.shape[0], x.shape[2], 2 * x.shape[1])), x.new_empty((x.shape[0], x.shape[1], 1))


def run_interpreted(x: Tensor, state: Tensor, alpha: Tensor, beta: Tensor, lengths: Tensor, log_params: bool,
                    in_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The tiled Triton kernel on CPU tensors under Triton's interpreter (``snake.run_interpreted``)."""
    _check(x, state)
    return snake._launch(x, state, alpha, beta, lengths, log_params, in_bias, pairs=True)
