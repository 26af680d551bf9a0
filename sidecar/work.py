"""The unit of work the engine, graph routines and models agree on (a plain record, no behaviour)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class DecodeItem:
    """One chunk for the engine. ``slot`` None = stateless (window mode: decode from an empty state)."""

    codes: Tensor  # [Q, n] int64, on CPU
    slot: int | None
    skip_frames: int  # leading frames whose audio is not returned (context frames, window left context)
