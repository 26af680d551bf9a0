"""``docs/configuration.md`` against the config model: its key table has one row per key of ``ServerConfig`` (the
pydantic model ``serve`` loads, walked here section by section), in the model's order, with the key's type and
default as the model declares them and a meaning; no row for a key that does not exist. A key added to
``sidecar/config.py`` fails here until the doc has its row (the failure prints the rows to paste)."""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from code2wav.sidecar.config import ServerConfig
from conftest import ROOT

DOC = ROOT / "docs" / "configuration.md"
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _bounds(metadata: Any) -> str:
    """``>= 1`` etc. of annotated-types constraints, also inside a ``Field(...)`` used as ``Annotated`` metadata."""
    flat = [c for m in metadata for c in (m.metadata if isinstance(m, FieldInfo) else [m])]
    return ", ".join(f"{symbol} {getattr(m, attr)}" for m in flat for attr, symbol in _BOUNDS
                     if getattr(m, attr, None) is not None)


def type_text(annotation: Any, metadata: Any = ()) -> str:
    """A field's type as the doc writes it: ``int >= 1``, ``int or "auto"``, ``list of int >= 1 or null``."""
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *inner = get_args(annotation)
        return type_text(base, [*metadata, *inner])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg, () if arg is type(None) else metadata) for arg in get_args(annotation))
    if origin is Literal:
        return " \\| ".join(f'"{arg}"' for arg in get_args(annotation))
    if origin is tuple:
        return f"list of {type_text(get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    bounds = _bounds(metadata)
    return f"{annotation.__name__} {bounds}" if bounds else annotation.__name__


def default_text(field: Any) -> str:
    """A field's default as YAML writes it (byte counts with their size); a computed one is named so."""
    if field.default_factory is not None:
        return "computed (see meaning)"
    value = field.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        gib = value / (1 << 30)
        size = f"{gib:g} GiB" if gib >= 1 else f"{value >> 20} MiB"
        return f"`{value}` ({size})"
    return f"`{value}`"


def config_keys(model: type[BaseModel] = ServerConfig, prefix: str = "") -> list[tuple[str, Any]]:
    """Every key of the config, dotted (``streams.ttl_s``), with its field, in the model's order."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += config_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append((prefix + name, field))
    return keys


def doc_rows() -> dict[str, list[str]]:
    """The key table's rows: key -> [type, default, meaning]."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_.0-9]+)` \| (.*) \|$", line)
        if m:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
            assert len(cells) == 3, line
            rows[m.group(1)] = cells
    return rows


def test_every_config_key_has_its_row_with_the_models_type_and_default():
    keys = config_keys()
    rows = doc_rows()
    expected = {key: [type_text(field.annotation, field.metadata), default_text(field)] for key, field in keys}
    wrong = [f"| `{key}` | {' | '.join(cells)} | MEANING |" for key, cells in expected.items()
             if rows.get(key, [None, None])[:2] != cells]
    assert wrong == [], "docs/configuration.md: add or fix these rows:\n" + "\n".join(wrong)
    assert sorted(set(rows) - set(expected)) == [], "rows for keys the config does not have"
    assert list(rows) == list(expected), "the rows in the model's order"
    assert [key for key, cells in rows.items() if len(cells[2]) < 10] == [], "every key needs its meaning"
    assert len(keys) >= 43  # the walk reaches every section (43 keys once graphs.compile and its cache dir went)


def test_the_type_and_default_renderings():
    """The renderer itself: it fails on a wrong bound, a wrong default or a missing union member."""
    fields = dict(config_keys())
    assert type_text(fields["streams.max_streams"].annotation, fields["streams.max_streams"].metadata) == \
        "int >= 1 or null"
    assert type_text(fields["busy_poll_us"].annotation, fields["busy_poll_us"].metadata) == 'int >= 0 or "auto"'
    assert type_text(fields["graphs.exact_frames"].annotation) == "list of int >= 1 or null"
    assert type_text(fields["dtype"].annotation) == '"float32" \\| "bfloat16" \\| "float16"'
    assert default_text(fields["streams.state_memory_margin_bytes"]) == "`8589934592` (8 GiB)"
    assert default_text(fields["limits.max_message_bytes"]) == "`67108864` (64 MiB)"
    assert default_text(fields["cuda_ipc"]) == "`true`" and default_text(fields["model_name"]) == "`null`"
    assert default_text(fields["address"]) == "computed (see meaning)"
