"""The unit of work the engine, graph routines and models agree on (plain records, no behaviour)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from code2wav.proto import ErrorCode


class ChunkRejected(Exception):
    """A chunk (or request) refused with a typed error; the caller answers it and carries on."""

    def __init__(self, code: ErrorCode, message: str, failed_seq: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.failed_seq = failed_seq  # an earlier early-answered chunk's seq (proto ErrorInfo.failed_seq), if any


@dataclass
class DecodeItem:
    """One chunk for the engine. ``slot`` None = stateless (window mode: decode from an empty state)."""

    codes: Tensor  # [C, n] on CPU: int64 codes or float32 latents (the model's InputSpec)
    slot: int | None
    skip_frames: int  # leading frames whose audio is not returned (context frames, window left context)
    out_device: bool = False  # audio wanted on the device (CUDA IPC output), not copied to the host
    options: dict[str, int] = field(default_factory=dict)  # the stream's options (missing: the default)
    armed: Any = None  # ipc.doorbells.ArmedInputs: the device waits for the row's doorbell before reading ``codes``

    @property
    def num_frames(self) -> int:
        """``n``: the frames decoded for this chunk (its skipped ones included)."""
        return self.codes.shape[1]
