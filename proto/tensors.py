"""Tensor descriptors: dtype, shape and where a tensor's bytes are.

Rules: sans-IO; imports only the standard library (and, elsewhere in ``proto``,
msgpack); never zmq, torch or numpy; imports nothing outside ``proto``. The dtypes are ``dtypes.py``'s.

Bytes on the wire are little-endian and C-contiguous. A tensor is either inline
(frame ``i`` of the same multipart message; frame 0 is the header) or in a CUDA
IPC region the client registered earlier (``region_id``, ``offset``,
``nbytes``; see ``ipc.py``). Servers that do not advertise
``capabilities.cuda_ipc`` reject ``cuda_ipc`` descriptors with
``invalid_argument``; servers that do check every offset against the region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, Union

from ._check import INT64_MAX, as_map, check_int, invalid, reject_unknown_keys, type_name
from ._codegen import instance_builder
from .dtypes import WIRE_DTYPE_ITEMSIZES
from .errors import ProtocolError
from .wire_types import WireType, field_name

if TYPE_CHECKING:
    from .limits import Limits

__all__ = [
    "InlineLoc",
    "CudaIpcLoc",
    "TensorLoc",
    "TensorDesc",
    "TensorField",
    "inline_view",
]

_INLINE_KEYS = frozenset({"dtype", "shape", "loc", "frame"})
_NO_FRAME: Any = object()
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
        if type(obj) is not dict:
            as_map(obj, "tensor descriptor")  # raises, naming what it got
        dtype = obj.get("dtype")
        if type(dtype) is not str or dtype not in WIRE_DTYPE_ITEMSIZES:
            invalid(f"tensor dtype must be one of {', '.join(WIRE_DTYPE_ITEMSIZES)}; got {dtype!r}")
        shape = _parse_shape(obj.get("shape"), limits)
        loc_kind = obj.get("loc")
        if loc_kind == "inline":
            _check_keys(obj, _INLINE_KEYS, "inline tensor descriptor")
            frame = obj.get("frame", _NO_FRAME)
            if type(frame) is not int or not 1 <= frame < num_frames_in_message:  # (the common case passes)
                if frame is _NO_FRAME:
                    invalid("inline tensor descriptor is missing required key 'frame'")
                if num_frames_in_message < 2:
                    invalid("inline tensor descriptor in a message that has no tensor frames")
                check_int(frame, "tensor frame", lo=1, hi=num_frames_in_message - 1)  # raises
            return _new_desc(dtype, shape, _new_inline(frame))
        if loc_kind != "cuda_ipc":
            invalid(f"tensor loc must be 'inline' or 'cuda_ipc'; got {loc_kind!r}")
        _check_keys(obj, _CUDA_IPC_KEYS, "cuda_ipc tensor descriptor")
        for key in ("region", "offset", "nbytes"):
            if key not in obj:
                invalid(f"cuda_ipc tensor descriptor is missing required key {key!r}")
        loc = CudaIpcLoc(
            region_id=check_int(obj["region"], "tensor region", lo=0, hi=INT64_MAX),
            offset=check_int(obj["offset"], "tensor offset", lo=0, hi=INT64_MAX),
            nbytes=check_int(obj["nbytes"], "tensor nbytes", lo=0, hi=INT64_MAX),
        )
        desc = _new_desc(dtype, shape, loc)
        if loc.nbytes != desc.nbytes:
            invalid(f"cuda_ipc tensor nbytes is {loc.nbytes} but dtype {dtype} and shape {list(shape)} need "
                    f"{desc.nbytes}")
        return desc


_new_desc = instance_builder(TensorDesc)
_new_inline = instance_builder(InlineLoc)


def _check_keys(mapping: dict[Any, Any], allowed: frozenset[str], what: str) -> None:
    for key in mapping:
        if key not in allowed:
            if type(key) is not str:
                invalid(f"tensor descriptor has a non-string key of type {type_name(key)}")
            reject_unknown_keys(mapping, allowed, what)  # raises, naming the key


def _parse_shape(value: object, limits: Limits) -> tuple[int, ...]:
    if type(value) is not list:
        invalid(f"tensor shape must be an array of integers, got {type_name(value)}")
    if len(value) > limits.max_rank:
        invalid(f"tensor rank {len(value)} exceeds the limit of {limits.max_rank} (max_rank)")
    numel = 1
    for index, dim in enumerate(value):
        if type(dim) is not int or dim < 0 or dim > INT64_MAX:
            check_int(dim, f"tensor shape[{index}]", lo=0, hi=INT64_MAX)  # raises, naming the dimension
        numel *= dim
    if numel > limits.max_tensor_elements:
        invalid(f"tensor shape {value} has {numel} elements; the limit is {limits.max_tensor_elements} "
                "(max_tensor_elements)")
    return tuple(value)


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


class TensorField(WireType):
    """A field that holds a tensor descriptor (section 3); its errors name the field, then the descriptor's key."""

    type_doc, plural_doc, limits_doc = "tensor descriptor", "tensor descriptors", "section 3"

    def __init__(self) -> None:
        self.encode = TensorDesc.to_wire

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> TensorDesc:
            try:
                return TensorDesc.from_wire(value, limits, len(frames))
            except ProtocolError as exc:
                raise ProtocolError(exc.code, f"{field_name(path, key)}: {exc.message}") from None
        self.parse = parse
