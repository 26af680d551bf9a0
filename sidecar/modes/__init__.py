"""Stream modes as objects (``exact.py``, ``window.py``); ``MODES`` maps the wire name to the mode."""

from __future__ import annotations

from types import MappingProxyType

from .base import StreamMode
from .exact import ExactMode
from .window import WindowMode

MODES = MappingProxyType({mode.name: mode for mode in (ExactMode(), WindowMode())})
"""Read-only: the modes this sidecar serves, by wire name (proto.STREAM_MODES lists the same names)."""


def get_mode(name: str) -> StreamMode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown stream mode {name!r}; choose one of {sorted(MODES)}") from None


def mode_for(stateful: bool) -> StreamMode:
    """The mode whose rows are stateful (hold a slot) or not: for callers that only have ``DecodeItem``s."""
    return next(m for m in MODES.values() if m.stateful == stateful)


__all__ = ["MODES", "StreamMode", "ExactMode", "WindowMode", "get_mode", "mode_for"]
