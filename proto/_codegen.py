"""Builds a declaration's ``to_wire`` and its parser, once, as Python source compiled the way ``dataclasses``
writes ``__init__``: the loop over the fields is unrolled, so a message encodes and parses as fast as the
hand-written code it replaces, with nothing looked up per call.

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. Only field names (identifiers, checked) and
``repr`` of strings go into the source; encoders, parsers, defaults and rules are bound by name in the
function's namespace, and every check stays in them (``wire_types``, ``wire_containers``, the rules).

``to_wire``: a dict display of the fields (a message's ``"type"`` first, keys in wire order), each as it is or
through its wire type's encoder (arrays and nil written inline), then one ``if`` per field left off the wire
while it holds its default (``omit_default``) and a statement per field after such one.

``parse(value, path, key, limits, frames)``: the map's type; its ``first`` fields; its keys (strict: each one
known, lenient: each a string); then each field, by its wire type's parser or, missing, its default (or the
missing-key error); the instance (as ``instance_builder`` makes one); the rules in order, each returning None or the
object to use instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ._check import invalid, type_name
from .wire_containers import ArrayOf, Nullable
from .wire_types import WireType

__all__ = ["build_to_wire", "build_parse", "instance_builder"]

_ABSENT: Any = object()  # what ``dict.get`` gives for a missing key


def _compile(source: str, function: str, label: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """Run ``source`` (which defines ``function``) in ``namespace``; tracebacks name it ``<label>``."""
    exec(compile(source, f"<{label}>", "exec"), namespace)
    return namespace[function]


def _checked(name: str) -> str:
    if not name.isidentifier():
        raise ValueError(f"field name {name!r} is not an identifier")
    return name


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
        ref = f"self.{_checked(field.name)}"
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
    to_wire = _compile(source, "to_wire", f"to_wire of {type_name or 'record'}", namespace)
    to_wire.__doc__ = "The map this message puts on the wire (msgpack packs it as frame 0)."
    return to_wire


def instance_builder(cls: type) -> Callable[..., Any]:
    """``build(*values)``: an instance of the frozen dataclass ``cls`` from all its fields' values, in order,
    without running its ``__init__`` (which sets the fields one ``object.__setattr__`` at a time): for parsers,
    whose values are checked already. ``cls`` must have no ``__post_init__``."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__: build it with its constructor")
    names = tuple(field.name for field in dataclasses.fields(cls))
    new, set_attribute = object.__new__, object.__setattr__

    def build(*values: Any) -> Any:
        obj = new(cls)
        set_attribute(obj, "__dict__", dict(zip(names, values)))
        return obj
    return build


def _bad_key(key: object, path: str, allowed: frozenset[str]) -> None:
    if type(key) is not str:
        invalid(f"{path} has a non-string key of type {type_name(key)}")
    invalid(f"{path} has unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")


def _absent(field: Any, path: str) -> Any:
    """The value of a field whose key is missing: the missing-key error, or a fresh default (a factory's)."""
    if field.required:
        invalid(f"{path} is missing required key {field.name!r}")
    return field.absent_factory()


def _not_a_map(value: object, path: str) -> None:
    invalid(f"{path} must be a map, got {type_name(value)}")


def _key_check(strict: bool, top_level: bool) -> list[str]:
    """Strict: every key known (which also refuses a non-string one); lenient, nested: every key a string."""
    if not strict and top_level:
        return []
    test = "name not in _allowed" if strict else "type(name) is not str"
    return ["    for name in value:", f"        if {test}:", "            _bad_key(name, path, _allowed)"]


def build_parse(cls: type, fields: Sequence[Any], checks: Sequence[Callable[..., Any]], strict: bool,
                top_level: bool) -> Callable[[Any, str, str, Any, Sequence[Any]], Any]:
    """The parser of one declaration (``fields`` in constructor order): a map in, an instance out. A message's
    header keys were checked to be strings by ``codec.read_header``; a nested map's are checked here."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__: a parser does not run it")
    allowed = frozenset(field.name for field in fields) | ({"type"} if top_level else set())
    namespace: dict[str, Any] = {"_ABSENT": _ABSENT, "_absent": _absent, "_bad_key": _bad_key, "_allowed": allowed,
                                 "_not_a_map": _not_a_map, "_cls": cls, "_new": object.__new__,
                                 "_set_attribute": object.__setattr__}
    first, rest, entries = [], [], []
    for index, field in enumerate(fields):
        key, value = repr(_checked(field.name)), f"v{index}"
        namespace[f"_parse_{index}"], namespace[f"_field_{index}"] = field.kind.parse, field
        if field.required or field.absent_factory is not None:
            missing = f"_absent(_field_{index}, path)"
        else:
            missing = f"_default_{index}"
            namespace[missing] = field.absent
        parsed = f"_parse_{index}({value}, path, {key}, limits, frames)"
        (first if field.first else rest).append(f"    {value} = value.get({key}, _ABSENT)\n"
                                                f"    {value} = {missing} if {value} is _ABSENT else {parsed}")
        entries.append(f"{key}: {value}")
    rules = []
    for index, check in enumerate(checks):
        namespace[f"_rule_{index}"] = check
        rules.append(f"    obj = _rule_{index}(obj, path, limits, frames) or obj")
    source = "\n".join([
        "def parse(value, path, key, limits, frames):",
        "    if key:", "        path = f'{path}.{key}'",
        "    if type(value) is not dict:", "        _not_a_map(value, path)",
        *first, *_key_check(strict, top_level), *rest,
        "    obj = _new(_cls)",  # an instance without __init__, as instance_builder makes one
        f"    _set_attribute(obj, '__dict__', {{{', '.join(entries)}}})",
        *rules,
        "    return obj"])
    return _compile(source, "parse", f"parse of {cls.__name__}", namespace)
