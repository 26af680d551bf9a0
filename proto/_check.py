"""Field validation helpers shared by the decoders (private to ``proto``).

Rules: sans-IO; stdlib only; imports nothing outside ``proto``. Every helper
raises ``ProtocolError(INVALID_ARGUMENT)`` with a message naming the field.
``bool`` is never accepted where an ``int`` is expected (Python's ``bool`` is an
``int`` subclass; msgpack keeps them distinct and so do we).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NoReturn

from .errors import ErrorCode, ProtocolError

UINT64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


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


def require(obj: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in obj:
        invalid(f"{what} is missing required key {key!r}")
    return obj[key]


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


def get_int(
    obj: Mapping[str, Any], key: str, what: str, *, lo: int, hi: int = INT64_MAX, default: Any = MISSING
) -> int:
    value = obj.get(key, MISSING)
    if type(value) is int and lo <= value <= hi:  # the common case first; names are built only for errors
        return value
    if value is MISSING and default is not MISSING:
        return int(default)
    value = require(obj, key, what)
    return check_int(value, f"{what}.{key}", lo=lo, hi=hi)


def check_str(value: object, name: str, *, max_nbytes: int, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        invalid(f"{name} must be a string, got {type_name(value)}")
    nbytes = len(value.encode("utf-8", "surrogatepass"))
    if nbytes > max_nbytes:
        invalid(f"{name} is {nbytes} bytes long; the limit is {max_nbytes}")
    if not value and not allow_empty:
        invalid(f"{name} must not be empty")
    return value


def get_str(
    obj: Mapping[str, Any],
    key: str,
    what: str,
    *,
    max_nbytes: int,
    allow_empty: bool = False,
    default: Any = MISSING,
) -> str:
    if key not in obj and default is not MISSING:
        return str(default)
    value = require(obj, key, what)
    return check_str(value, f"{what}.{key}", max_nbytes=max_nbytes, allow_empty=allow_empty)


def get_optional_str(
    obj: Mapping[str, Any], key: str, what: str, *, max_nbytes: int, default: Any = MISSING
) -> str | None:
    if key not in obj and default is not MISSING:
        return None if default is None else str(default)
    value = require(obj, key, what)
    if value is None:
        return None
    return check_str(value, f"{what}.{key}", max_nbytes=max_nbytes)


def get_bool(obj: Mapping[str, Any], key: str, what: str, *, default: Any = MISSING) -> bool:
    if key not in obj and default is not MISSING:
        return bool(default)
    value = require(obj, key, what)
    if not isinstance(value, bool):
        invalid(f"{what}.{key} must be a boolean, got {type_name(value)}")
    return value


def get_positive_float(obj: Mapping[str, Any], key: str, what: str) -> float:
    value = require(obj, key, what)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        invalid(f"{what}.{key} must be a number, got {type_name(value)}")
    number = float(value)
    if not math.isfinite(number) or number <= 0.0:
        invalid(f"{what}.{key} must be a finite number > 0, got {value!r}")
    return number


def get_list(obj: Mapping[str, Any], key: str, what: str, *, max_len: int, limit_name: str = "") -> list[Any]:
    value = require(obj, key, what)
    if not isinstance(value, list):
        invalid(f"{what}.{key} must be an array, got {type_name(value)}")
    if len(value) > max_len:
        named = f" ({limit_name})" if limit_name else ""  # the limit's wire name, as in welcome.limits
        invalid(f"{what}.{key} has {len(value)} entries; the limit is {max_len}{named}")
    return value


def get_choice(
    obj: Mapping[str, Any], key: str, what: str, *, choices: tuple[str, ...], default: Any = MISSING
) -> str:
    if key not in obj and default is not MISSING:
        return str(default)
    value = require(obj, key, what)
    if not isinstance(value, str) or value not in choices:
        invalid(f"{what}.{key} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value
