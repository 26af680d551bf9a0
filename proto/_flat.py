"""The wire form shared by the flat messages: ``{"type": TYPE, field: value, ...}``, each field as it is (ints,
strings, None).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar


class FlatMessage:
    """Mixin for a frozen message dataclass whose fields all go on the wire as they are."""

    TYPE: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, **{f.name: getattr(self, f.name) for f in fields(self)}}  # type: ignore[arg-type]
