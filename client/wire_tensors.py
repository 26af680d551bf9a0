"""Tensors <-> wire: codes into (descriptor, frames), audio frames into torch tensors.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

``InlineTransport`` puts a host array's bytes in the message (one frame per
tensor, no copy). CUDA codes travel by CUDA IPC instead when the sidecar shares
the host and GPU (``cuda_ipc/``): only offsets go in the message.

Latents travel in their own dtype when the model takes it (welcome's ``input_dtypes``: float32, and bfloat16
on servers that list it); host bfloat16 goes inline as its raw bits (``HostBfloat16``: numpy has none).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, Union

import numpy as np
import torch

from code2wav.proto import INTEGER_DTYPES, WIRE_DTYPES, InlineLoc, TensorDesc, inline_view

from .errors import InvalidArgument

__all__ = ["CodesLike", "TensorTransport", "InlineTransport", "HostBfloat16", "as_wire_codes", "cuda_wire_codes",
           "host_wire", "latents_wire_dtype", "audio_from_frames", "host_id"]

CodesLike = Union[torch.Tensor, np.ndarray, Sequence[Sequence[int]]]

# the wire dtypes (proto's one list) as torch dtypes, by name: integers for codes, floats for latents
_TORCH_WIRE_INTS = frozenset(getattr(torch, dtype.name) for dtype in WIRE_DTYPES if dtype.is_integer)
_LATENT_DTYPES = {dtype.name: getattr(torch, dtype.name) for dtype in WIRE_DTYPES if not dtype.is_integer}
_FLOAT32_ALIGN = 4


@dataclass(frozen=True)
class HostBfloat16:
    """Host bfloat16 inputs ``[D, n]`` bound inline: numpy has no bfloat16, so they are the tensor's raw bits,
    a little-endian uint16 array sharing its memory; ``InlineTransport`` sends them as ``bfloat16``."""

    bits: np.ndarray  # [D, n] <u2

    @classmethod
    def of(cls, tensor: torch.Tensor) -> HostBfloat16:
        """A contiguous CPU bfloat16 tensor's bits (no copy on a little-endian host)."""
        return cls(np.asarray(tensor.view(torch.int16).numpy().view(np.uint16), dtype="<u2"))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes


def latents_wire_dtype(dtype_name: str, accepted: Sequence[str]) -> str:
    """The wire dtype float latents of ``dtype_name`` travel in: their own when it is a wire float (float32,
    bfloat16, float16), else float32 (e.g. numpy's float64). ``InvalidArgument`` before anything is sent when
    the model (welcome's ``input_dtypes``, ``accepted``) does not take it."""
    wire = dtype_name if dtype_name in _LATENT_DTYPES else "float32"
    if wire not in accepted:
        raise InvalidArgument(f"latents in {wire} are not accepted: the model takes {'/'.join(accepted) or 'none'} "
                              f"of shape [D, n]; convert them (e.g. .float())")
    return wire


def as_wire_codes(codes: CodesLike, latents: bool = False,
                  latent_dtypes: Sequence[str] = ("float32",)) -> np.ndarray | HostBfloat16:
    """Return codes as a C-contiguous little-endian int16/int32/int64 numpy array ``[Q, n]``; with ``latents``
    (the model's ``input_kind`` is ``latents``) float inputs ``[D, n]`` in their wire dtype
    (``latents_wire_dtype`` with ``latent_dtypes``, welcome's ``input_dtypes``) instead.

    No copy when ``codes`` already is one (a contiguous CPU torch tensor or numpy
    array of int16/int32/int64): the returned array shares its memory, so the
    caller must not modify ``codes`` until the chunk's reply arrived. Other
    integer dtypes are widened to int64 (a copy); floats and bools are refused.
    """
    if latents:
        return _wire_latents(codes, latent_dtypes)
    if isinstance(codes, torch.Tensor):
        tensor = codes.detach()
        if tensor.device.type != "cpu":  # device codes going inline (no CUDA IPC): one copy to the host
            tensor = tensor.cpu()
        if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
            raise InvalidArgument(f"codes must be an integer tensor, got {tensor.dtype}{_codes_hint(tensor.dtype)}")
        if tensor.dtype not in _TORCH_WIRE_INTS:
            tensor = tensor.to(torch.int64)
        array = tensor.contiguous().numpy()
    else:
        array = np.asarray(codes)
        if array.dtype.kind not in "iu":
            raise InvalidArgument(f"codes must be an integer array, got dtype {array.dtype}"
                                  f"{_codes_hint(array.dtype)}")
        if array.dtype.name not in INTEGER_DTYPES:
            array = array.astype(np.int64)
        array = np.ascontiguousarray(array)
    if array.ndim != 2:
        raise InvalidArgument(f"codes must have shape [num_quantizers, num_frames], got {list(array.shape)}")
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def _wire_latents(latents: CodesLike, accepted: Sequence[str]) -> np.ndarray | HostBfloat16:
    """Float latents ``[D, n]``, C-contiguous and little-endian, in their wire dtype (no copy when already so)."""
    if isinstance(latents, torch.Tensor):
        tensor = latents.detach().cpu()  # (no copy on the host; CUDA latents going inline: one copy)
        if not tensor.is_floating_point():
            raise InvalidArgument(f"latents must be a floating-point tensor, got {tensor.dtype}{_LATENTS_HINT}")
        _check_latents_rank(tensor.shape)
        wire = latents_wire_dtype(str(tensor.dtype).removeprefix("torch."), accepted)
        tensor = tensor.to(_LATENT_DTYPES[wire]).contiguous()  # [D, n]
        return HostBfloat16.of(tensor) if wire == "bfloat16" else tensor.numpy()
    array = np.asarray(latents)
    if array.dtype.kind != "f":
        raise InvalidArgument(f"latents must be a float array, got dtype {array.dtype}{_LATENTS_HINT}")
    _check_latents_rank(array.shape)
    wire = latents_wire_dtype(array.dtype.name, accepted)  # (numpy has no bfloat16)
    return np.ascontiguousarray(array, dtype="<f2" if wire == "float16" else "<f4")  # [D, n]


_LATENTS_HINT = " (this model decodes float latents [D, n]; integer codes are for a codes model such as Qwen3-TTS)"


def _codes_hint(dtype: Any) -> str:
    """A float dtype sent to a codes model: the words that say latents belong to another kind of model."""
    floating = dtype.is_floating_point if isinstance(dtype, torch.dtype) else np.dtype(dtype).kind == "f"
    return " (this model decodes integer codes [Q, n]; float latents are for a latents model such as VoxCPM2)" \
        if floating else ""


def _check_latents_rank(shape: Sequence[int]) -> None:
    if len(shape) != 2:
        raise InvalidArgument(f"latents must have shape [channels, num_frames], got {list(shape)}")


def cuda_wire_codes(codes: torch.Tensor, latents: bool = False,
                    latent_dtypes: Sequence[str] = ("float32",)) -> torch.Tensor:
    """CUDA codes as a contiguous int16/int32/int64 device tensor ``[Q, n]`` (the tensor itself when already
    one; integer tensors never require grad, so there is nothing to detach). ``latents``: ``[D, n]`` in their
    wire dtype (``latents_wire_dtype``: bfloat16 stays bfloat16 when the model takes it)."""
    if latents:
        if not codes.is_floating_point():
            raise InvalidArgument(f"latents must be a floating-point tensor, got {codes.dtype}{_LATENTS_HINT}")
        _check_latents_rank(codes.shape)
        wire = latents_wire_dtype(str(codes.dtype).removeprefix("torch."), latent_dtypes)
        return codes.detach().to(_LATENT_DTYPES[wire]).contiguous()
    if codes.dtype not in _TORCH_WIRE_INTS:
        if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
            raise InvalidArgument(f"codes must be an integer tensor, got {codes.dtype}{_codes_hint(codes.dtype)}")
        codes = codes.to(torch.int64)
    if codes.dim() != 2:
        raise InvalidArgument(f"codes must have shape [num_quantizers, num_frames], got {list(codes.shape)}")
    return codes.contiguous()


def host_wire(inputs: Any) -> np.ndarray | HostBfloat16:
    """Wire inputs as ``InlineTransport`` takes them: CUDA tensors (``cuda_wire_codes``) going inline are copied
    to the host here; host inputs (``as_wire_codes``) are returned as they are."""
    if not isinstance(inputs, torch.Tensor):
        return inputs
    host = inputs.cpu()
    return HostBfloat16.of(host) if host.dtype == torch.bfloat16 else host.numpy()


class TensorTransport(Protocol):
    """Turns a host array into a descriptor and the frames that carry its bytes."""

    def pack(self, array: np.ndarray | HostBfloat16, first_frame: int) -> tuple[TensorDesc, list[Any]]:
        """``first_frame`` is the message frame index the first returned frame will have."""
        ...


class InlineTransport:
    """Bytes travel in the message itself, one frame per tensor, without a copy."""

    def pack(self, array: np.ndarray | HostBfloat16, first_frame: int) -> tuple[TensorDesc, list[Any]]:
        dtype, raw = ("bfloat16", array.bits) if isinstance(array, HostBfloat16) else (array.dtype.name, array)
        desc = TensorDesc(dtype=dtype, shape=tuple(int(d) for d in raw.shape), loc=InlineLoc(first_frame))
        # memoryview keeps ``raw`` alive until zmq has sent the frame (copy=False).
        frame: Any = memoryview(raw).cast("B") if raw.nbytes else b""
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
