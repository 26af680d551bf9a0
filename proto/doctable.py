"""The protocol doc's field tables, made from the message declarations: ``proto/README.md`` holds one per
message and nested map between ``<!-- fields: Name -->`` and ``<!-- /fields -->``, and a test checks that they
are what this module gives, so the doc cannot drift from the code.

Rules: sans-IO (functions return text; ``python -m code2wav.proto.doctable`` prints every table, to paste into
the README after a declaration changed); stdlib only; imports nothing outside ``proto``.
"""

from __future__ import annotations

from typing import Any

from .declare import Declaration, WireField
from .messages import CLIENT_MESSAGES, SERVER_MESSAGES
from .wire_containers import ArrayOf, Nullable
from .wire_types import WireType

__all__ = ["field_table", "declared_records", "tables", "markdown", "BEGIN", "END"]

BEGIN = "<!-- fields: {name} -->"
END = "<!-- /fields -->"
_HEADER = "| field | type | required / default | limits | meaning |\n|---|---|---|---|---|"


def _literal(value: Any) -> str:
    """A default as the wire writes it (msgpack values in JSON notation)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(key)}: {_literal(item)}" for key, item in value.items()) + "}"
    return repr(value)


def _presence(field: WireField) -> str:
    if field.required:
        return "required"
    default = field.absent_factory() if field.absent_factory is not None else field.absent
    text = f"optional, default `{_literal(default)}`"
    return text + ("; sent only when not the default" if field.omit_default else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else ""


def field_table(cls: type) -> str:
    """The Markdown field table of a declared class, and its rules under it."""
    declaration: Declaration = cls.WIRE  # type: ignore[attr-defined]
    rows = [f"| `{field.name}` | {_cell(field.kind.type_doc)} | {_presence(field)} | {_cell(field.kind.limits_doc)} "
            f"| {_cell(field.doc)} |" for field in declaration.fields]
    rules = [f"- {text}" for text, _ in declaration.rules]
    return "\n".join([_HEADER, *rows, *(["", "Rules:", "", *rules] if rules else [])])


def _nested(kind: WireType) -> list[type]:
    if isinstance(kind, (ArrayOf, Nullable)):
        return _nested(kind.item if isinstance(kind, ArrayOf) else kind.inner)
    declaration = getattr(kind, "declaration", None)
    return [declaration.cls] if isinstance(declaration, Declaration) else []


def declared_records() -> list[type]:
    """Every message, then the maps nested in it (depth first), each once: the order of ``markdown``."""
    found: list[type] = []

    def visit(cls: type) -> None:
        if cls in found:
            return
        found.append(cls)
        for field in cls.WIRE.fields:  # type: ignore[attr-defined]
            for nested in _nested(field.kind):
                visit(nested)
    for cls in (*CLIENT_MESSAGES, *SERVER_MESSAGES):
        visit(cls)
    return found


def tables() -> dict[str, str]:
    """``{class name: field table}`` of every declared message and nested map."""
    return {cls.__name__: field_table(cls) for cls in declared_records()}


def markdown() -> str:
    """Every table inside its README markers, one after another."""
    return "\n\n".join(f"{BEGIN.format(name=name)}\n{table}\n{END}" for name, table in tables().items())


if __name__ == "__main__":
    print(markdown())
