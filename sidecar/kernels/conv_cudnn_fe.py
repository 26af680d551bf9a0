"""A dense stride-1 conv through cuDNN's frontend graph API (``nvidia-cudnn-frontend``; one of ``ConvChoice``'s forms).

PyTorch calls cuDNN through its own heuristic choice of one engine per shape (no autotuning: benchmark mode is
off in the server), and on Hopper it picked sm80 and CUTLASS-2 kernels for several of the decoders' convs. The
frontend's graph API builds an operation graph for the exact shape and strides (``[B, C, 1, L]`` channels-last,
weight ``[C_out, C_in, 1, K]`` channels-last, the dilation on the second spatial axis), asks heuristics A with the
fallback list for its execution plans and builds them; cuDNN then runs the first plan that supports the graph, with
a workspace allocated once per graph. One graph per input shape, built on first use (at warm-up: measuring is not
allowed inside a CUDA graph capture, so a capture only replays graphs built before). The output is channels-last
``[B, C_out, T]``; the bias is added by the caller's Snake kernel (``in_bias``) or here in one pass.

The package is optional: without it, or with a cuDNN older than the frontend needs, the form is not offered
(``available`` says why once, in the log). Offered for 16-bit inputs only (float32 stays where the server's
no-TF32 rule is PyTorch's to keep).
"""

from __future__ import annotations

import logging
from functools import cache

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@cache
def available() -> bool:
    """Whether the frontend imports and its cuDNN runs here (checked once per process, the reason logged once)."""
    try:
        import cudnn  # noqa: F401, PLC0415  (nvidia-cudnn-frontend)

        cudnn.backend_version()
    except Exception as exc:  # noqa: BLE001  (ImportError, a missing libcudnn, an old backend)
        log.info("cuDNN frontend form not offered: %s: %s (pip install nvidia-cudnn-frontend to measure it)",
                 type(exc).__name__, exc)
        return False
    return True


class FrontendConvs:
    """The built cuDNN graphs of one conv module, per input shape and layout."""

    def __init__(self) -> None:
        self.graphs: dict[tuple, object] = {}

    def run(self, x: Tensor, weight_cl: Tensor, dilation: int) -> Tensor:
        """``conv1d(x, weight)`` without bias ``[B, C_out, T]`` (channels-last), ``weight_cl`` ``[C_out, C_in, 1, K]``
        channels-last (``weight_4d``)."""
        x4 = x.unsqueeze(2)  # [B, C_in, 1, L]
        if not x4.is_contiguous(memory_format=torch.channels_last):
            x4 = x4.contiguous(memory_format=torch.channels_last)
        key = (tuple(x4.shape), x4.stride(), x4.dtype, x4.device, tuple(weight_cl.shape))
        graph = self.graphs.get(key)
        if graph is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a cuDNN frontend graph is built at warm-up, not inside a CUDA graph capture")
            graph = self.graphs[key] = _build(x4, weight_cl, dilation)
        y4 = graph(x4, weight_cl)  # [B, C_out, 1, T]
        return y4[:, :, 0]  # [B, C_out, T]


def weight_4d(weight: Tensor) -> Tensor:
    """``weight`` ``[C_out, C_in, K]`` as ``[C_out, C_in, 1, K]`` channels-last (detached)."""
    return weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)  # [C_out, C_in, 1, K]


def _build(x4: Tensor, weight_cl: Tensor, dilation: int):
    import cudnn  # noqa: PLC0415

    io_type = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[x4.dtype]

    with cudnn.Graph(handle="auto", io_data_type=io_type,
                     intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT) as graph:
        y = graph.conv_fprop(image=x4, weight=weight_cl, padding=[0, 0], stride=[1, 1], dilation=[1, dilation],
                             name="conv")
        y.set_output(True).set_data_type(io_type)
    graph.set_io_tuples(["conv::image", "conv::weight"], ["conv::Y"])
    return graph
