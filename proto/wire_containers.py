"""The container wire types: nil-or-a-value, arrays, pairs and maps of a declared field (scalars: ``wire_types.py``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. As in ``wire_types``: each parses with a closure
built once, names the field (an array's entry as ``name[i]``) only for an error, and encodes with ``encode``
(None: as it is). A declared record class stands for its map (``as_wire_type``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ._check import INT64_MAX, as_map, check_int, invalid, type_name
from .wire_types import WireType, bound_doc, field_name

__all__ = ["as_wire_type", "Nullable", "ArrayOf", "IntPair", "IntMap", "KnownKeys", "AnyMap"]


def as_wire_type(kind: Any) -> WireType:
    """``kind`` itself, or the wire type of a declared record class (its ``WIRE.wire_type``)."""
    if isinstance(kind, WireType):
        return kind
    wire_type = getattr(getattr(kind, "WIRE", None), "wire_type", None)
    if isinstance(wire_type, WireType):
        return wire_type
    raise TypeError(f"not a wire type or a declared record: {kind!r}")


class Nullable(WireType):
    """``inner`` or nil (None)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner = as_wire_type(inner)
        self.type_doc, self.limits_doc = f"{inner.type_doc} or nil", inner.limits_doc
        inner_parse, inner_encode = inner.parse, inner.encode
        if inner_encode is not None:
            self.encode = lambda value: None if value is None else inner_encode(value)

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> Any:
            return None if value is None else inner_parse(value, path, key, limits, frames)
        self.parse = parse


class ArrayOf(WireType):
    """An array of at most ``max_len`` entries (a number or a limit's name), parsed into a tuple."""

    def __init__(self, item: Any, max_len: int | str) -> None:
        self.item = item = as_wire_type(item)
        self.type_doc = f"array of {item.plural_doc or item.type_doc}"
        self.limits_doc = f"<= {bound_doc(max_len)} entries" + (f"; each {item.limits_doc}" if item.limits_doc else "")
        named = f" ({max_len})" if isinstance(max_len, str) else ""  # a limit's wire name, as in welcome.limits
        item_parse, item_encode = item.parse, item.encode
        self.encode = list if item_encode is None else (lambda values: [item_encode(v) for v in values])

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> tuple[Any, ...]:
            name = field_name(path, key)
            if type(value) is not list:
                invalid(f"{name} must be an array, got {type_name(value)}")
            top = getattr(limits, max_len) if named else max_len
            if len(value) > top:
                invalid(f"{name} has {len(value)} entries; the limit is {top}{named}")
            return tuple([item_parse(entry, f"{name}[{index}]", "", limits, frames)
                          for index, entry in enumerate(value)])
        self.parse = parse


class IntPair(WireType):
    """``[low, high]``: two integers, read into a tuple."""

    type_doc, limits_doc = "`[low, high]`", "ints"
    encode = list

    def __init__(self) -> None:
        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> tuple[int, int]:
            name = field_name(path, key)
            if type(value) is not list:
                invalid(f"{name} must be an array, got {type_name(value)}")
            if len(value) != 2:
                invalid(f"{name} must be [low, high], got {len(value)} entries")
            low, high = (check_int(bound, f"{name}[{i}]", lo=-INT64_MAX, hi=INT64_MAX) for i, bound in enumerate(value))
            return (low, high)
        self.parse = parse


class IntMap(WireType):
    """A map of names (at most ``max_id_len`` UTF-8 bytes) to integers, at most ``max_len`` entries; nil reads as
    empty."""

    type_doc = "map str -> int"
    encode = dict

    def __init__(self, max_len: int) -> None:
        self.limits_doc = f"<= {max_len} entries; names <= `max_id_len` UTF-8 bytes; nil reads as empty"

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> dict[str, int]:
            if value is None:
                return {}
            name = field_name(path, key)
            mapping = as_map(value, name)
            if len(mapping) > max_len:
                invalid(f"{name} has {len(mapping)} entries; the limit is {max_len}")
            for entry, number in mapping.items():
                if len(entry.encode("utf-8", "surrogatepass")) > limits.max_id_len:
                    invalid(f"{name} has a name longer than {limits.max_id_len} bytes")
                check_int(number, f"{name}.{entry}", lo=-INT64_MAX, hi=INT64_MAX)
            return dict(mapping)
        self.parse = parse


class KnownKeys(WireType):
    """A map whose known keys are checked (each with its wire type) and kept; unknown keys are dropped (a peer
    may advertise what this version does not know). Encoded as it is."""

    type_doc = "map"
    encode = dict

    def __init__(self, known: Mapping[str, WireType]) -> None:
        fields = tuple(known.items())
        self.limits_doc = "; ".join(f"`{key}`: {kind.type_doc}" for key, kind in fields) + "; unknown keys ignored"

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> dict[str, Any]:
            name = field_name(path, key)
            mapping = as_map(value, name)
            return {entry: kind.parse(mapping[entry], name, entry, limits, frames)
                    for entry, kind in fields if entry in mapping}
        self.parse = parse


class AnyMap(WireType):
    """A map with string keys, kept as it is."""

    type_doc = "map"
    encode = dict

    def __init__(self) -> None:
        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> dict[str, Any]:
            return dict(as_map(value, field_name(path, key)))
        self.parse = parse
