"""The wire dtypes: the one list of the element types a tensor may have on the wire, with item sizes and kinds.

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. Everything else derives its dtype tables from
``WIRE_DTYPES`` by name (the client's torch dtypes, the sidecar's numpy dtypes and its models' accepted input
dtypes); a dtype's name is the torch and numpy name of that type (numpy has no ``bfloat16``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WireDtype", "WIRE_DTYPES", "WIRE_DTYPE_ITEMSIZES", "INTEGER_DTYPES", "FLOAT_DTYPES"]


@dataclass(frozen=True)
class WireDtype:
    """One wire dtype: ``name`` (as ``TensorDesc.dtype`` carries it), ``itemsize`` in bytes, ``kind``."""

    name: str
    itemsize: int
    kind: str  # "integer" | "float"

    @property
    def is_integer(self) -> bool:
        return self.kind == "integer"


WIRE_DTYPES: tuple[WireDtype, ...] = (
    WireDtype("int16", 2, "integer"),
    WireDtype("int32", 4, "integer"),
    WireDtype("int64", 8, "integer"),
    WireDtype("float16", 2, "float"),
    WireDtype("bfloat16", 2, "float"),
    WireDtype("float32", 4, "float"),
)
"""Little-endian, C-contiguous on the wire (protocol section 3)."""

WIRE_DTYPE_ITEMSIZES: dict[str, int] = {dtype.name: dtype.itemsize for dtype in WIRE_DTYPES}
"""Dtypes allowed on the wire, with their item sizes in bytes."""

INTEGER_DTYPES: frozenset[str] = frozenset(dtype.name for dtype in WIRE_DTYPES if dtype.is_integer)
FLOAT_DTYPES: frozenset[str] = frozenset(dtype.name for dtype in WIRE_DTYPES if not dtype.is_integer)
