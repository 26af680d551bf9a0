"""Value checks shared by the wire types and the tensor descriptor parser (private to ``proto``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. Every helper
raises ``ProtocolError(INVALID_ARGUMENT)`` with a message naming the field.
``bool`` is never accepted where an ``int`` is expected (Python's ``bool`` is an
``int`` subclass; msgpack keeps them distinct and so do we).
"""

from __future__ import annotations

from typing import Any, Mapping, NoReturn

from .errors import ErrorCode, ProtocolError

UINT64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1


def invalid(message: str) -> NoReturn:
    raise ProtocolError(ErrorCode.INVALID_ARGUMENT, message)


def type_name(value: object) -> str:
    if value is None:
        return "nil"
    return type(value).__name__


def as_map(value: object, what: str) -> dict[str, Any]:
    if type(value) is not dict:
        invalid(f"{what} must be a map, got {type_name(value)}")
    for key in value:
        if type(key) is not str:  # msgpack gives exactly dict and str (raw=False)
            invalid(f"{what} has a non-string key of type {type_name(key)}")
    return value


def reject_unknown_keys(obj: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    for key in obj:
        if key not in allowed:
            invalid(f"{what} has unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")


def is_int(value: object) -> bool:
    return type(value) is int


def check_int(value: object, name: str, *, lo: int, hi: int) -> int:
    if type(value) is int and lo <= value <= hi:  # the common case first
        return value
    if not is_int(value):
        invalid(f"{name} must be an integer, got {type_name(value)}")
    assert isinstance(value, int)
    if value < lo or value > hi:
        invalid(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_str(value: object, name: str, *, max_nbytes: int, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        invalid(f"{name} must be a string, got {type_name(value)}")
    nbytes = len(value.encode("utf-8", "surrogatepass"))
    if nbytes > max_nbytes:
        invalid(f"{name} is {nbytes} bytes long; the limit is {max_nbytes}")
    if not value and not allow_empty:
        invalid(f"{name} must not be empty")
    return value
