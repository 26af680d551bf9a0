"""A dense stride-1 conv as one cuBLAS GEMM over an im2col copy of its input (one of ``ConvChoice``'s forms).

``x`` ``[B, C_in, L]`` is copied to the rows ``a[(b, t), (k, c)] = x[b, c, t + k d]`` ``[B T, K C_in]`` and multiplied
by the weight as ``[K C_in, C_out]``: ``y[(b, t), :] = bias + a[(b, t), :] @ w`` ``[B T, C_out]``, returned as the view
``[B, C_out, T]`` (channels-last: each column's channels contiguous). The copy reads ``x`` channels-last rows when it
is laid out so (a Snake kernel writes it so for free) and costs ``K`` times the input's bytes, so ``ConvChoice``
offers the form only where that copy stays under ``MAX_COPY_NBYTES`` (small and medium shapes: the batch-1 steps and
the early, short layers; at batch 64 the late layers' copy would be gigabytes). cuBLAS picks its own Hopper kernel
for the GEMM (vLLM-Omni's own streaming decoder takes this route, with a Triton im2col).
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_COPY_NBYTES = 256 << 20
"""The largest im2col copy the form is offered for (it lives in the step's memory, and a CUDA graph's pool)."""


def copy_nbytes(x_shape: tuple[int, ...], ksize: int, dilation: int, element_size: int) -> int:
    """Bytes of the im2col copy for an input of ``x_shape`` ``(B, C_in, L)``."""
    batch, c_in, num_in = x_shape
    return batch * max(num_in - (ksize - 1) * dilation, 0) * ksize * c_in * element_size


def gemm_weight(weight: Tensor) -> Tensor:
    """``weight`` ``[C_out, C_in, K]`` as the GEMM's ``[K C_in, C_out]`` (rows ordered tap-major, as the copy)."""
    c_out, c_in, ksize = weight.shape
    return weight.detach().permute(2, 1, 0).reshape(ksize * c_in, c_out).contiguous()  # [K C_in, C_out]


def im2col_conv(x: Tensor, weight_kc: Tensor, bias: Tensor | None, ksize: int, dilation: int) -> Tensor:
    """``conv1d(x, weight) + bias`` ``[B, C_out, T]`` (a channels-last view) with ``weight_kc`` from ``gemm_weight``."""
    batch, c_in, num_in = x.shape
    num_cols = num_in - (ksize - 1) * dilation
    span = (ksize - 1) * dilation + 1
    taps = x.unfold(2, span, 1)[..., ::dilation]  # [B, C_in, T, K] view
    a = taps.permute(0, 2, 3, 1).reshape(batch * num_cols, ksize * c_in)  # [B T, K C_in] (the copy)
    if bias is None:
        y = torch.mm(a, weight_kc)  # [B T, C_out]
    else:
        y = torch.addmm(bias, a, weight_kc)  # [B T, C_out]
    return y.view(batch, num_cols, -1).transpose(1, 2)  # [B, C_out, T], channels-last
