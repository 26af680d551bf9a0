"""Builds a declaration's ``to_wire``: the map a message puts on the wire, keys in its declared wire order.

Rules: sans-IO; stdlib only; imports nothing outside ``proto``.

The method is written once per declaration as Python source and compiled, as ``dataclasses`` writes
``__init__``: a dict display of the fields (a message's ``"type"`` first), each as it is or through its wire
type's encoder (arrays and nil written inline), then one ``if`` per field left off the wire while it equals its
default (``omit_default``) and a statement per field after such one. So a message encodes as fast as a
hand-written ``to_wire``, with nothing looked up per call. Only field names (identifiers, checked) and
``repr`` of strings go into the source; encoders and defaults are bound by name in the function's namespace.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .wire_containers import ArrayOf, Nullable
from .wire_types import WireType

__all__ = ["build_to_wire"]


def _value(kind: WireType, ref: str, namespace: dict[str, Any]) -> str:
    """The expression that encodes ``ref`` (an attribute of ``self``, or an array's entry) for the wire."""
    if isinstance(kind, Nullable):
        inner = _value(kind.inner, ref, namespace)
        return ref if inner == ref else f"(None if {ref} is None else {inner})"
    if isinstance(kind, ArrayOf):
        entry = _value(kind.item, "entry", namespace)
        return f"list({ref})" if entry == "entry" else f"[{entry} for entry in {ref}]"
    if kind.encode is None:
        return ref
    name = f"_encode_{len(namespace)}"
    namespace[name] = kind.encode
    return f"{name}({ref})"


def build_to_wire(type_name: str | None, fields: Sequence[Any]) -> Callable[[Any], dict[str, Any]]:
    """``to_wire(self) -> dict`` for ``fields`` (``declare.WireField``, in wire order)."""
    namespace: dict[str, Any] = {}
    display = [f"'type': {type_name!r}"] if type_name is not None else []
    statements: list[str] = []
    for field in fields:
        if not field.name.isidentifier():
            raise ValueError(f"field name {field.name!r} is not an identifier")
        ref = f"self.{field.name}"
        if not field.omit_default:
            value = _value(field.kind, ref, namespace)
            if statements:
                statements.append(f"    wire[{field.name!r}] = {value}")
            else:
                display.append(f"{field.name!r}: {value}")
            continue
        default = field.absent if field.absent_factory is None else field.absent_factory()
        if default is None:  # sent only when not nil, so written without the nil case
            inner = field.kind.inner if isinstance(field.kind, Nullable) else field.kind
            test, value = f"{ref} is not None", _value(inner, ref, namespace)
        else:
            name = f"_default_{len(namespace)}"
            namespace[name] = default
            test, value = f"{ref} != {name}", _value(field.kind, ref, namespace)
        statements.append(f"    if {test}:\n        wire[{field.name!r}] = {value}")
    source = "\n".join(["def to_wire(self):", f"    wire = {{{', '.join(display)}}}", *statements, "    return wire"])
    exec(compile(source, f"<to_wire of {type_name or 'record'}>", "exec"), namespace)
    to_wire = namespace["to_wire"]
    to_wire.__doc__ = "The map this message puts on the wire (msgpack packs it as frame 0)."
    return to_wire
