"""Tensor descriptors: dtype, shape and where a tensor's bytes are.

Rules: sans-IO; imports only the standard library (and, elsewhere in ``proto``,
msgpack); never zmq, torch or numpy; imports nothing outside ``proto``.

Bytes on the wire are little-endian and C-contiguous. A tensor is either inline
(frame ``i`` of the same multipart message; frame 0 is the header) or in a CUDA
IPC region the client registered earlier (``region_id``, ``offset``,
``nbytes``; see ``ipc.py``). Servers that do not advertise
``capabilities.cuda_ipc`` reject ``cuda_ipc`` descriptors with
``invalid_argument``; servers that do check every offset against the region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from ._check import INT64_MAX, as_map, check_int, invalid, reject_unknown_keys, type_name
from .limits import Limits

__all__ = [
    "WIRE_DTYPE_ITEMSIZES",
    "INTEGER_DTYPES",
    "LATENT_DTYPES",
    "InlineLoc",
    "CudaIpcLoc",
    "TensorLoc",
    "TensorDesc",
    "inline_view",
]

WIRE_DTYPE_ITEMSIZES: dict[str, int] = {
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
}
"""Dtypes allowed on the wire, with their item sizes in bytes."""

INTEGER_DTYPES: frozenset[str] = frozenset({"int16", "int32", "int64"})
LATENT_DTYPES: frozenset[str] = frozenset({"float32", "bfloat16"})
"""Dtypes of float decoder inputs (latents ``[D, n]``, e.g. VoxCPM2's AudioVAE); codes use ``INTEGER_DTYPES``."""

_INLINE_KEYS = frozenset({"dtype", "shape", "loc", "frame"})
_CUDA_IPC_KEYS = frozenset({"dtype", "shape", "loc", "region", "offset", "nbytes"})


@dataclass(frozen=True)
class InlineLoc:
    """The tensor's bytes are frame ``frame`` of the same message (>= 1)."""

    frame: int


@dataclass(frozen=True)
class CudaIpcLoc:
    """The tensor's bytes are ``nbytes`` at ``offset`` in a registered CUDA IPC region."""

    region_id: int
    offset: int
    nbytes: int


TensorLoc = Union[InlineLoc, CudaIpcLoc]


@dataclass(frozen=True)
class TensorDesc:
    """Describes one tensor of a message."""

    dtype: str
    shape: tuple[int, ...]
    loc: TensorLoc

    @property
    def itemsize(self) -> int:
        return WIRE_DTYPE_ITEMSIZES[self.dtype]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if isinstance(self.loc, InlineLoc):
            wire["loc"] = "inline"
            wire["frame"] = self.loc.frame
        else:
            wire["loc"] = "cuda_ipc"
            wire["region"] = self.loc.region_id
            wire["offset"] = self.loc.offset
            wire["nbytes"] = self.loc.nbytes
        return wire

    @classmethod
    def from_wire(cls, obj: object, limits: Limits, num_frames_in_message: int) -> TensorDesc:
        """Parse and validate a descriptor; raises ``ProtocolError(INVALID_ARGUMENT)``."""
        mapping = as_map(obj, "tensor descriptor")
        dtype = mapping.get("dtype")
        if not isinstance(dtype, str) or dtype not in WIRE_DTYPE_ITEMSIZES:
            invalid(
                f"tensor dtype must be one of {', '.join(WIRE_DTYPE_ITEMSIZES)}; got {dtype!r}"
            )
        shape = _parse_shape(mapping.get("shape"), limits)
        loc_kind = mapping.get("loc")
        loc: TensorLoc
        if loc_kind == "inline":
            reject_unknown_keys(mapping, _INLINE_KEYS, "inline tensor descriptor")
            if "frame" not in mapping:
                invalid("inline tensor descriptor is missing required key 'frame'")
            if num_frames_in_message < 2:
                invalid("inline tensor descriptor in a message that has no tensor frames")
            frame = check_int(mapping["frame"], "tensor frame", lo=1, hi=num_frames_in_message - 1)
            loc = InlineLoc(frame=frame)
        elif loc_kind == "cuda_ipc":
            reject_unknown_keys(mapping, _CUDA_IPC_KEYS, "cuda_ipc tensor descriptor")
            for key in ("region", "offset", "nbytes"):
                if key not in mapping:
                    invalid(f"cuda_ipc tensor descriptor is missing required key {key!r}")
            loc = CudaIpcLoc(
                region_id=check_int(mapping["region"], "tensor region", lo=0, hi=INT64_MAX),
                offset=check_int(mapping["offset"], "tensor offset", lo=0, hi=INT64_MAX),
                nbytes=check_int(mapping["nbytes"], "tensor nbytes", lo=0, hi=INT64_MAX),
            )
        else:
            invalid(f"tensor loc must be 'inline' or 'cuda_ipc'; got {loc_kind!r}")
        desc = cls(dtype=dtype, shape=shape, loc=loc)
        if isinstance(loc, CudaIpcLoc) and loc.nbytes != desc.nbytes:
            invalid(
                f"cuda_ipc tensor nbytes is {loc.nbytes} but dtype {dtype} and shape "
                f"{list(shape)} need {desc.nbytes}"
            )
        return desc


def _parse_shape(value: object, limits: Limits) -> tuple[int, ...]:
    if not isinstance(value, list):
        invalid(f"tensor shape must be an array of integers, got {type_name(value)}")
    if len(value) > limits.max_rank:
        invalid(f"tensor rank {len(value)} exceeds the limit of {limits.max_rank}")
    numel = 1
    for index, dim in enumerate(value):
        if type(dim) is not int or dim < 0 or dim > INT64_MAX:
            check_int(dim, f"tensor shape[{index}]", lo=0, hi=INT64_MAX)  # raises, naming the dimension
        numel *= dim
    dims = list(value)
    if numel > limits.max_tensor_elements:
        invalid(
            f"tensor shape {dims} has {numel} elements; the limit is {limits.max_tensor_elements}"
        )
    return tuple(dims)


def inline_view(desc: TensorDesc, frames: Sequence[Any]) -> memoryview:
    """Return the bytes of an inline tensor as a flat byte ``memoryview`` (no copy).

    ``frames`` is the whole message (frame 0 is the header). The frame's length
    must equal ``desc.nbytes`` exactly.
    """
    if not isinstance(desc.loc, InlineLoc):
        invalid("tensor is not inline (cuda_ipc tensors have no frame)")
    index = desc.loc.frame
    if index < 1 or index >= len(frames):
        invalid(f"tensor frame {index} is out of range: the message has {len(frames)} frames")
    view = memoryview(frames[index])
    if view.nbytes != desc.nbytes:
        invalid(
            f"tensor frame {index} holds {view.nbytes} bytes but dtype {desc.dtype} and "
            f"shape {list(desc.shape)} need {desc.nbytes} bytes"
        )
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
