"""The scalar wire types a declared field can have: how a value is checked and parsed, encoded, and described in
the doc (arrays, maps and nil: ``wire_containers.py``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. A wire type is built once per declared field;
its ``parse(value, path, key, limits, frames)`` is a closure over its bounds, checks the common case first and
builds the field's name (``path.key``) only for an error. Every error is ``ProtocolError(INVALID_ARGUMENT)``
naming the field (``Version``: VERSION_MISMATCH). ``encode`` is None when the value goes on the wire as it is.
A bound written as a name (``"max_id_len"``) is read from the ``Limits`` the message is parsed with.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ._check import INT64_MAX, UINT64_MAX, check_int, check_str, invalid, type_name
from .errors import ErrorCode, ProtocolError

__all__ = ["WireType", "Int", "CountOrNone", "UINT64", "Version", "Str", "Bool", "PositiveFloat", "NonNegativeFloat",
           "Choice", "ErrorCodeField", "UnknownErrorCode", "field_name", "bound_doc"]

Parse = Callable[[Any, str, str, Any, Sequence[Any]], Any]


def field_name(path: str, key: str) -> str:
    """``path.key`` (``path`` alone for an array entry, whose path already ends in ``[i]``)."""
    return f"{path}.{key}" if key else path


def bound_doc(bound: int | str) -> str:
    """A bound as the doc writes it: a limit's name in backticks, 2^63-1 and the like as powers of two."""
    if isinstance(bound, str):
        return f"`{bound}`"
    sign, magnitude = ("-" if bound < 0 else ""), abs(bound)
    for exponent in (64, 63):
        if magnitude == 2**exponent - 1:
            return f"-(2^{exponent}-1)" if sign else f"2^{exponent}-1"
    if magnitude >= 2**16 and magnitude & (magnitude - 1) == 0:
        return f"{sign}2^{magnitude.bit_length() - 1}"
    return str(bound)


class WireType:
    """Base: ``type_doc`` and ``limits_doc`` fill the doc table's columns; ``parse`` and ``encode`` as above."""

    type_doc = ""
    plural_doc = ""
    limits_doc = ""
    encode: Callable[[Any], Any] | None = None
    parse: Parse


class Int(WireType):
    """An integer in ``[lo, hi]`` (``hi`` may name a limit); a bool is never an integer."""

    type_doc, plural_doc = "int", "ints"

    def __init__(self, lo: int = 0, hi: int | str = INT64_MAX) -> None:
        self.lo, self.hi = lo, hi
        self.limits_doc = f"{bound_doc(lo)}..{bound_doc(hi)}"
        if isinstance(hi, str):
            limit = hi

            def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> int:
                top = getattr(limits, limit)
                if type(value) is int and lo <= value <= top:
                    return value
                return check_int(value, field_name(path, key), lo=lo, hi=top)
        else:
            top = hi

            def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> int:
                if type(value) is int and lo <= value <= top:
                    return value
                return check_int(value, field_name(path, key), lo=lo, hi=top)
        self.parse = parse


UINT64 = Int(0, UINT64_MAX)
"""``request_id``: 0..2^64-1."""


class CountOrNone(Int):
    """A count that may be "none": an integer >= 0 on the wire, where 0 is read as None and None is sent as 0, so
    a peer that predates the None reading sees the 0 it always saw (``model.codebook_size`` of a latents model)."""

    def __init__(self) -> None:
        super().__init__(0)
        read_int = self.parse

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> int | None:
            return read_int(value, path, key, limits, frames) or None
        self.parse = parse

    @staticmethod
    def encode(value: int | None) -> int:
        return 0 if value is None else value


class Version(Int):
    """The protocol version a ``hello`` carries: another version is VERSION_MISMATCH, naming both."""

    def __init__(self, version: int) -> None:
        super().__init__(version, version)
        self.limits_doc = f"must be `{version}`, else `version_mismatch`"

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> int:
            if type(value) is not int:
                invalid(f"{field_name(path, key)} must be an integer, got {type_name(value)}")
            if value != version:
                raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                                    f"this server speaks protocol version {version}; {path} carried version {value}")
            return value
        self.parse = parse


class Str(WireType):
    """A string of at most ``max_nbytes`` UTF-8 bytes (a number or a limit's name), non-empty unless ``empty``."""

    type_doc, plural_doc = "str", "str"

    def __init__(self, max_nbytes: int | str = "max_id_len", empty: bool = False) -> None:
        self.limits_doc = f"{'' if empty else 'non-empty, '}<= {bound_doc(max_nbytes)} UTF-8 bytes"
        min_len, limit = (0 if empty else 1), (max_nbytes if isinstance(max_nbytes, str) else "")

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> str:
            top = getattr(limits, limit) if limit else max_nbytes
            if type(value) is str and min_len <= len(value) and 4 * len(value) <= top:  # (<= 4 bytes a character)
                return value
            return check_str(value, field_name(path, key), max_nbytes=top, allow_empty=empty)
        self.parse = parse


class Bool(WireType):
    type_doc = "bool"

    def __init__(self) -> None:
        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> bool:
            if value is True or value is False:
                return value
            invalid(f"{field_name(path, key)} must be a boolean, got {type_name(value)}")
        self.parse = parse


class _FiniteFloat(WireType):
    """A finite number at or above ``0`` (``allow_zero``) or above it (an integer is read as a float); always sent as
    a float. The two subclasses below name the bound."""

    type_doc = "float"
    encode = float
    allow_zero = False

    def __init__(self) -> None:
        allow_zero, bound = self.allow_zero, ">= 0" if self.allow_zero else "> 0"

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> float:
            name = field_name(path, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                invalid(f"{name} must be a number, got {type_name(value)}")
            number = float(value)
            if not math.isfinite(number) or number < 0.0 or (number == 0.0 and not allow_zero):
                invalid(f"{name} must be a finite number {bound}, got {value!r}")
            return number
        self.parse = parse


class PositiveFloat(_FiniteFloat):
    """A finite number > 0 (an integer is read as a float); always sent as a float."""

    limits_doc = "finite, > 0"


class NonNegativeFloat(_FiniteFloat):
    """A finite number >= 0 (an integer is read as a float); always sent as a float."""

    limits_doc, allow_zero = "finite, >= 0", True


class Choice(WireType):
    """One of a few strings."""

    def __init__(self, choices: Sequence[str]) -> None:
        options = tuple(choices)
        self.type_doc = " or ".join(f'`"{choice}"`' for choice in options)

        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> str:
            if type(value) is str and value in options:
                return value
            invalid(f"{field_name(path, key)} must be one of {', '.join(repr(c) for c in options)}; got {value!r}")
        self.parse = parse


class UnknownErrorCode(str):
    """An error code this version does not know, as parsed; the message's rule turns it into INTERNAL."""


class ErrorCodeField(WireType):
    """An error code (protocol section 7); an unknown one parses as ``UnknownErrorCode``."""

    type_doc, limits_doc = "str", "an error code (section 7)"

    @staticmethod
    def encode(code: Any) -> str:
        return code.value

    def __init__(self) -> None:
        def parse(value: Any, path: str, key: str, limits: Any, frames: Sequence[Any]) -> ErrorCode | str:
            if type(value) is not str:
                invalid(f"{field_name(path, key)} must be a string, got {type_name(value)}")
            try:
                return ErrorCode(value)
            except ValueError:
                return UnknownErrorCode(value)
        self.parse = parse
