"""Tensors <-> wire: codes into (descriptor, frames), audio frames into torch tensors.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

``InlineTransport`` puts a host array's bytes in the message (one frame per
tensor, no copy). CUDA codes travel by CUDA IPC instead when the sidecar shares
the host and GPU (``cuda_ipc/``): only offsets go in the message.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, Sequence, Union

import numpy as np
import torch

from code2wav.proto import INTEGER_DTYPES, InlineLoc, TensorDesc, inline_view

from .errors import InvalidArgument

__all__ = ["CodesLike", "TensorTransport", "InlineTransport", "as_wire_codes", "cuda_wire_codes", "as_wire_inputs",
           "cuda_wire_inputs", "audio_from_frames", "host_id"]

CodesLike = Union[torch.Tensor, np.ndarray, Sequence[Sequence[int]]]

_TORCH_WIRE_INTS = {torch.int16, torch.int32, torch.int64}
_FLOAT32_ALIGN = 4


def as_wire_codes(codes: CodesLike) -> np.ndarray:
    """Return codes as a C-contiguous little-endian int16/int32/int64 numpy array ``[Q, n]``.

    No copy when ``codes`` already is one (a contiguous CPU torch tensor or numpy
    array of int16/int32/int64): the returned array shares its memory, so the
    caller must not modify ``codes`` until the chunk's reply arrived. Other
    integer dtypes are widened to int64 (a copy); floats and bools are refused.
    """
    if isinstance(codes, torch.Tensor):
        tensor = codes.detach()
        if tensor.device.type != "cpu":  # device codes going inline (no CUDA IPC): one copy to the host
            tensor = tensor.cpu()
        if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
            raise InvalidArgument(f"codes must be an integer tensor, got {tensor.dtype}")
        if tensor.dtype not in _TORCH_WIRE_INTS:
            tensor = tensor.to(torch.int64)
        array = tensor.contiguous().numpy()
    else:
        array = np.asarray(codes)
        if array.dtype.kind not in "iu":
            raise InvalidArgument(f"codes must be an integer array, got dtype {array.dtype}")
        if array.dtype.name not in INTEGER_DTYPES:
            array = array.astype(np.int64)
        array = np.ascontiguousarray(array)
    if array.ndim != 2:
        raise InvalidArgument(f"codes must have shape [num_quantizers, num_frames], got {list(array.shape)}")
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def cuda_wire_codes(codes: torch.Tensor) -> torch.Tensor:
    """CUDA codes as a contiguous int16/int32/int64 device tensor ``[Q, n]`` (the tensor itself when already
    one; integer tensors never require grad, so there is nothing to detach)."""
    if codes.dtype not in _TORCH_WIRE_INTS:
        if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
            raise InvalidArgument(f"codes must be an integer tensor, got {codes.dtype}")
        codes = codes.to(torch.int64)
    if codes.dim() != 2:
        raise InvalidArgument(f"codes must have shape [num_quantizers, num_frames], got {list(codes.shape)}")
    return codes.contiguous()


def _is_float(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_floating_point()
    return isinstance(x, np.ndarray) and x.dtype.kind == "f"


def as_wire_inputs(inputs: CodesLike) -> np.ndarray:
    """Codes (integer, see ``as_wire_codes``) or latents (float: a C-contiguous little-endian float32 array
    ``[D, n]``; float64/float16/bfloat16 are converted, a copy). Non-finite latents are refused here already."""
    if not _is_float(inputs):
        return as_wire_codes(inputs)
    if isinstance(inputs, torch.Tensor):
        array = inputs.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    else:
        array = np.ascontiguousarray(inputs, dtype="<f4")
    if array.ndim != 2:
        raise InvalidArgument(f"latents must have shape [latent_dim, num_frames], got {list(array.shape)}")
    if not np.isfinite(array).all():
        raise InvalidArgument("latents contain NaN or Inf")
    return array


def cuda_wire_inputs(inputs: torch.Tensor) -> torch.Tensor:
    """CUDA codes (see ``cuda_wire_codes``) or CUDA latents: a contiguous float32 device tensor ``[D, n]`` (other
    float dtypes are converted on the device: the inline fallback goes through numpy, which has no bfloat16, and
    the VAE decodes float32 latents anyway). The server checks finiteness after reading them."""
    if not inputs.is_floating_point():
        return cuda_wire_codes(inputs)
    if inputs.dtype != torch.float32:
        inputs = inputs.to(torch.float32)
    if inputs.dim() != 2:
        raise InvalidArgument(f"latents must have shape [latent_dim, num_frames], got {list(inputs.shape)}")
    return inputs.detach().contiguous()


class TensorTransport(Protocol):
    """Turns a host array into a descriptor and the frames that carry its bytes."""

    def pack(self, array: np.ndarray, first_frame: int) -> tuple[TensorDesc, list[Any]]:
        """``first_frame`` is the message frame index the first returned frame will have."""
        ...


class InlineTransport:
    """Bytes travel in the message itself, one frame per tensor, without a copy."""

    def pack(self, array: np.ndarray, first_frame: int) -> tuple[TensorDesc, list[Any]]:
        desc = TensorDesc(dtype=array.dtype.name, shape=tuple(int(d) for d in array.shape), loc=InlineLoc(first_frame))
        # memoryview keeps ``array`` alive until zmq has sent the frame (copy=False).
        frame: Any = memoryview(array).cast("B") if array.nbytes else b""
        return desc, [frame]


def audio_from_frames(desc: TensorDesc, frames: Sequence[Any]) -> torch.Tensor:
    """Build the float32 audio tensor of an inline descriptor, without a copy when possible.

    ``frames`` are the received message's buffers (``zmq.Frame.buffer``
    memoryviews); the tensor keeps its frame alive. A copy is made only when
    the frame is read-only (torch tensors must be writable), misaligned for
    float32 (ZeroMQ may place small messages at any offset of its receive
    buffer), or the host is big-endian.
    """
    view = inline_view(desc, frames)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.float32)
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    if view.readonly or address % _FLOAT32_ALIGN != 0 or sys.byteorder != "little":
        samples = np.frombuffer(view, dtype="<f4").astype(np.float32)  # the copy
        return torch.from_numpy(samples)
    return torch.frombuffer(view, dtype=torch.float32)


def host_id() -> str | None:
    """The kernel boot id, shared by every process and container on one host (CUDA IPC needs one host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None
