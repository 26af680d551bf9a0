"""Each wire message is declared once (``proto/declare.py``): its parser, its encoder and its doc table come from
the declaration. The README's tables are what the declarations give; adding an optional field keeps old peers
working both ways; the wire dtypes are one list."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from code2wav import proto
from code2wav.proto import (CLIENT_MESSAGES, SERVER_MESSAGES, OpenStream, Pong, ProtocolError,
                            decode_client_message, decode_server_message, encode)
from code2wav.proto.codec import decode_message, parsers
from code2wav.proto.declare import message, record, rule, wire
from code2wav.proto.doctable import BEGIN, END, field_table, tables
from code2wav.proto.wire_containers import Nullable
from code2wav.proto.wire_types import UINT64, Int, PositiveFloat, Str

README = Path(proto.__file__).parent / "README.md"


def _readme_tables(text: str) -> dict[str, str]:
    pattern = re.escape(BEGIN).replace(r"\{name\}", r"(\w+)") + r"\n(.*?)\n" + re.escape(END)
    return {name: body for name, body in re.findall(pattern, text, re.S)}


def _stale_tables(text: str) -> list[str]:
    """The declared maps whose table in ``text`` (the README) is missing or differs from the declaration."""
    documented = _readme_tables(text)
    return [name for name, table in tables().items() if documented.get(name) != table]


def test_readme_field_tables_are_the_declarations() -> None:
    stale = _stale_tables(README.read_text())
    assert not stale, (f"proto/README.md's tables of {stale} differ from the declarations: paste them from "
                       "`python -m code2wav.proto.doctable`:\n\n" + "\n\n".join(tables()[name] for name in stale))
    assert sorted(_readme_tables(README.read_text())) == sorted(tables())  # and no table of a removed map


def test_the_table_check_catches_a_drifted_or_missing_table() -> None:
    text = README.read_text()
    assert _stale_tables(text.replace('optional, default `"exact"`', 'optional, default `"window"`', 1)) == \
        ["OpenStream"]
    assert _stale_tables(text.replace("<!-- fields: Pong -->", "<!-- fields: Ping2 -->")) == ["Pong"]


def test_every_message_is_declared_with_its_type_and_direction() -> None:
    types = [cls.TYPE for cls in (*CLIENT_MESSAGES, *SERVER_MESSAGES)]
    assert len(types) == len(set(types)) == 18
    assert all(cls.WIRE.sender == "client" and cls.WIRE.strict for cls in CLIENT_MESSAGES)
    assert all(cls.WIRE.sender == "server" and not cls.WIRE.strict for cls in SERVER_MESSAGES)
    assert all(cls.WIRE.type_name == cls.TYPE for cls in (*CLIENT_MESSAGES, *SERVER_MESSAGES))


def test_a_table_shows_types_defaults_limits_and_rules() -> None:
    table = tables()["Chunk"]
    assert "| `context_frames` | int | optional, default `0` | 0..2^63-1 |" in table
    assert "| `codes_event` | int or nil | optional, default `nil`; sent only when not the default | 0..63 |" in table
    assert "`context_frames <= n`" in table.split("Rules:")[1]
    assert "| `left_context_frames` | int | optional, default `0` | 0..`max_left_context_frames` |" in \
        tables()["OpenStream"]


# ------------------------------------------------------------------------------------- adding an optional field


@message("open_stream", sender="client")
class OpenStreamWithPriority(OpenStream):
    """A newer client's ``open_stream``: one optional field more, declared in one line."""

    priority: int = wire(Int(0, 7), default=0, omit_default=True, doc="scheduling priority (higher first)")


@message("pong", sender="server")
class PongWithUptime(Pong):
    """A newer server's ``pong``: one optional field more."""

    uptime_s: float | None = wire(Nullable(PositiveFloat()), default=None, omit_default=True,
                                  doc="seconds since the server started")


NEW_SERVER = parsers([OpenStreamWithPriority])
NEW_CLIENT = parsers([PongWithUptime])


def test_a_new_client_field_left_at_its_default_is_not_on_the_wire() -> None:
    newer, older = OpenStreamWithPriority(5, "s", mode="window", left_context_frames=25), OpenStream(5, "s", None,
                                                                                                     "window", 25)
    assert encode(newer) == encode(older)  # byte for byte: an old (strict) server accepts it
    assert decode_client_message(encode(newer)) == older


def test_a_new_server_reads_the_field_or_its_default() -> None:
    assert decode_message(encode(OpenStream(6, "s")), NEW_SERVER).priority == 0  # an old client's message
    sent = OpenStreamWithPriority(7, "s", priority=3)
    assert msgpack.unpackb(encode(sent)[0])["priority"] == 3
    assert decode_message(encode(sent), NEW_SERVER) == sent
    with pytest.raises(ProtocolError, match="priority must be in \\[0, 7\\], got 9") as info:
        decode_message(encode(OpenStreamWithPriority(8, "s", priority=9)), NEW_SERVER)
    assert info.value.request_id == 8
    with pytest.raises(ProtocolError, match="unknown key 'priority'"):  # an old server names what it does not know
        decode_client_message(encode(sent))


def test_a_new_server_field_is_ignored_by_old_clients_and_read_by_new_ones() -> None:
    assert encode(PongWithUptime(1, "e")) == encode(Pong(1, "e"))
    loaded = PongWithUptime(2, "e", uptime_s=0.75)
    assert decode_server_message(encode(loaded)) == Pong(2, "e")  # old client: lenient
    assert decode_message(encode(loaded), NEW_CLIENT) == loaded
    assert decode_message(encode(Pong(3, "e")), NEW_CLIENT).uptime_s is None  # an old server's pong
    with pytest.raises(ProtocolError, match="pong.uptime_s must be a number, got str"):  # known fields are checked
        decode_message([msgpack.packb({"type": "pong", "request_id": 4, "boot_epoch": "e", "uptime_s": "high"})],
                       NEW_CLIENT)


def test_the_new_field_is_in_its_table_and_the_base_rules_stay() -> None:
    assert ("| `priority` | int | optional, default `0`; sent only when not the default | 0..7 | scheduling priority"
            in field_table(OpenStreamWithPriority))
    assert field_table(OpenStreamWithPriority).startswith(field_table(OpenStream))

    @record("chunk", sender="client")
    class ChunkWithTag(proto.Chunk):
        tag: str | None = wire(Nullable(Str()), default=None, omit_default=True)
    assert [text for text, _ in ChunkWithTag.WIRE.rules] == [text for text, _ in proto.Chunk.WIRE.rules]


# ------------------------------------------------------------------------------------------ declaration errors


def test_declarations_refuse_what_cannot_travel() -> None:
    with pytest.raises(TypeError, match="not declared with wire"):
        @message("x", sender="client")
        class Bare:
            request_id: int
    with pytest.raises(TypeError, match="omit_default needs an optional field"):
        @message("y", sender="client")
        class Required:
            request_id: int = wire(UINT64, omit_default=True)
    with pytest.raises(ValueError, match="sender must be one of"):
        @message("z", sender="both")
        class Nobody:
            request_id: int = wire(UINT64)


def test_a_rule_may_replace_what_was_parsed() -> None:
    @message("note", sender="server")
    class Note:
        request_id: int = wire(UINT64)
        level: int = wire(Int(0, 9), default=0)

        @rule("`level` above 5 reads as 5.")
        def _clamp(self, path: str, limits: Any, frames: Any) -> Any:
            return Note(self.request_id, 5) if self.level > 5 else None
    assert decode_message([msgpack.packb({"type": "note", "request_id": 1, "level": 8})], parsers([Note])).level == 5
    assert "- `level` above 5 reads as 5." in field_table(Note)


# ------------------------------------------------------------------------------------------------ wire dtypes


def test_wire_dtypes_are_one_list() -> None:
    names = [dtype.name for dtype in proto.WIRE_DTYPES]
    assert names == ["int16", "int32", "int64", "float16", "bfloat16", "float32"]
    assert proto.WIRE_DTYPE_ITEMSIZES == {"int16": 2, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
                                          "float32": 4}
    assert proto.INTEGER_DTYPES == {"int16", "int32", "int64"}
    assert proto.FLOAT_DTYPES == {"float16", "bfloat16", "float32"}
    assert proto.ModelInfo("m", 1, 2, 3, 4, (), "f", "d").input_dtypes == ("int16", "int32", "int64")


def test_the_readme_lists_the_wire_dtypes() -> None:
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `dtype` |"))
    listed = re.findall(r"`(\w+)` \((\d+)", row.split(";")[0])  # "`int16` (2 bytes), `int32` (4), ..."
    assert listed == [(dtype.name, str(dtype.itemsize)) for dtype in proto.WIRE_DTYPES]
