"""Declaring a wire message once: its fields, their wire types, defaults, limits and rules; the parser, the encoder
and the doc's field table all come from that one declaration.

Rules: sans-IO; stdlib only; imports nothing outside ``proto``.

A message (or a map nested in one, such as a chunk) is a class whose fields are ``wire(...)`` declarations::

    @message("open_stream", sender="client")
    class OpenStream:
        request_id: int = wire(UINT64)
        stream_id: str = wire(Str(), doc="unique among this client's open streams")
        mode: str = wire(Choice(STREAM_MODES), default="exact", doc="see section 5")

        @rule("... the rule's text for the doc ...")
        def _a_rule(self, path, limits, frames): ...   # raises ProtocolError; may return a replacement

``message`` / ``record`` make it a frozen dataclass (the constructor is the fields in order, with their defaults)
and give it ``WIRE`` (its ``Declaration``, whose ``parse`` is the parser), ``to_wire`` and, for a message,
``TYPE`` (the wire ``type``); ``_codegen.py`` writes the parser and ``to_wire``. ``sender="client"`` parses
strictly (an unknown key is an error naming it), ``sender="server"`` leniently (unknown keys are ignored, a
newer server may add fields); known keys are always checked, each by its wire type (``wire_types``,
``wire_containers``), then the rules run in the order the class declares them. A field with a default is
optional on the wire (absent: the default; ``absent=`` when the wire's default differs, e.g. for a field the
constructor requires); ``required=True`` makes it required on the wire anyway; ``omit_default=True`` leaves it
off the wire while it equals its default, so peers that predate it keep working; ``first=True`` checks it
before anything else (``hello.version``). A subclass of a declared class, declared in turn, is the message with
more fields (a newer version of it), its base's rules included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ._codegen import build_parse, build_to_wire
from .wire_containers import as_wire_type
from .wire_types import WireType

__all__ = ["wire", "rule", "message", "record", "Declaration", "WireField", "Record"]

_NOTHING: Any = object()  # "not given"
_RULE_TEXT = "__wire_rule__"
SENDERS = ("client", "server")


@dataclass(frozen=True)
class WireField:
    """One declared field: ``required`` on the wire or else ``absent`` (or ``absent_factory()``) when missing."""

    name: str
    kind: WireType
    required: bool
    absent: Any
    absent_factory: Callable[[], Any] | None
    omit_default: bool
    first: bool
    doc: str


@dataclass(frozen=True)
class _Pending:
    kind: WireType
    required: bool | None
    absent: Any
    omit_default: bool
    first: bool
    doc: str


@dataclass(frozen=True)
class Declaration:
    """What ``message`` / ``record`` made of a class: its fields in wire order, its rules (doc text, check)."""

    cls: type
    type_name: str | None  # the wire ``type`` of a message; None for a nested map
    doc_name: str
    sender: str
    fields: tuple[WireField, ...]
    rules: tuple[tuple[str, Callable[..., Any]], ...]
    parse: Callable[[Any, str, str, Any, Sequence[Any]], Any]

    @property
    def wire_type(self) -> Record:
        """This map as the wire type of a field that holds it."""
        return Record(self)

    @property
    def strict(self) -> bool:
        return self.sender == "client"

    def parse_message(self, header: dict[str, Any], limits: Any, frames: Sequence[Any]) -> Any:
        """Parse a message's header (``codec`` checks framing and sizes and scopes errors to the request id)."""
        return self.parse(header, self.doc_name, "", limits, frames)


class Record(WireType):
    """A declared map nested in a field (a chunk, a model entry)."""

    def __init__(self, declaration: Declaration) -> None:
        self.declaration = declaration
        self.type_doc, self.plural_doc = f"{declaration.doc_name} map", f"{declaration.doc_name} maps"
        self.encode = declaration.cls.to_wire  # type: ignore[attr-defined]
        self.parse = declaration.parse


def wire(kind: Any, *, default: Any = _NOTHING, default_factory: Any = _NOTHING, required: bool | None = None,
         absent: Any = _NOTHING, omit_default: bool = False, first: bool = False, doc: str = "") -> Any:
    """Declare a field: its wire type (a ``WireType`` or a declared record class) and how it travels (module
    docstring); ``doc`` is its meaning in the doc table."""
    pending = _Pending(as_wire_type(kind), required, absent, omit_default, first, doc)
    options: dict[str, Any] = {}
    if default is not _NOTHING:
        options["default"] = default
    if default_factory is not _NOTHING:
        options["default_factory"] = default_factory
    return dataclasses.field(metadata={"wire": pending}, **options)


def rule(text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method ``(self, path, limits, frames)`` as a rule of its message: ``text`` goes under its doc table;
    the method runs after the fields parsed, raises ``ProtocolError`` naming the field, and returns None or the
    object to use instead."""
    def mark(check: Callable[..., Any]) -> Callable[..., Any]:
        setattr(check, _RULE_TEXT, text)
        return check
    return mark


def message(type_name: str, *, sender: str, order: Sequence[str] = ()) -> Callable[[type], type]:
    """Declare a message whose wire ``type`` is ``type_name``, sent by ``"client"`` or ``"server"``."""
    return lambda cls: _declare(cls, type_name, type_name, sender, order)


def record(doc_name: str, *, sender: str, order: Sequence[str] = ()) -> Callable[[type], type]:
    """Declare a map nested in messages (``doc_name`` names it in the doc: ``chunk``, ``model``)."""
    return lambda cls: _declare(cls, None, doc_name, sender, order)


def _wire_field(field: dataclasses.Field, owner: str) -> WireField:
    pending = field.metadata.get("wire")
    if not isinstance(pending, _Pending):
        raise TypeError(f"{owner}.{field.name} is not declared with wire(...)")
    if pending.absent is not _NOTHING:  # the wire's default is not the constructor's
        absent, factory = pending.absent, None
    elif field.default_factory is not dataclasses.MISSING:
        absent, factory = dataclasses.MISSING, field.default_factory
    else:
        absent, factory = field.default, None  # MISSING when the field has no default
    optional = factory is not None or absent is not dataclasses.MISSING
    required = not optional if pending.required is None else pending.required
    if pending.omit_default and (required or not optional):
        raise TypeError(f"{owner}.{field.name}: omit_default needs an optional field with a default")
    return WireField(field.name, pending.kind, required, absent, factory, pending.omit_default, pending.first,
                     pending.doc)


def _declare(cls: type, type_name: str | None, doc_name: str, sender: str, order: Sequence[str]) -> type:
    if sender not in SENDERS:
        raise ValueError(f"sender must be one of {SENDERS}, got {sender!r}")
    marked: dict[str, Any] = {}  # a subclass (a message's newer version) keeps its base's rules
    for owner in reversed(cls.__mro__):
        marked.update((name, check) for name, check in vars(owner).items() if hasattr(check, _RULE_TEXT))
    rules = tuple((getattr(check, _RULE_TEXT), check) for check in marked.values())
    cls = dataclass(frozen=True)(cls)
    fields = tuple(_wire_field(field, cls.__name__) for field in dataclasses.fields(cls))
    by_name = {field.name: field for field in fields}
    if order and sorted(order) != sorted(by_name):
        raise TypeError(f"{cls.__name__}: order must name every field once")
    wire_fields = tuple(by_name[name] for name in order) if order else fields
    parse = build_parse(cls, fields, tuple(check for _, check in rules), sender == "client", type_name is not None)
    cls.WIRE = Declaration(cls, type_name, doc_name, sender, wire_fields, rules, parse)  # type: ignore[attr-defined]
    cls.to_wire = build_to_wire(type_name, wire_fields)  # type: ignore[attr-defined]
    if type_name is not None:
        cls.TYPE = type_name  # type: ignore[attr-defined]
    return cls
