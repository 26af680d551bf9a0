"""What a pooled stream keeps on the host so that another sidecar can take it over (``pool_stream.py``;
proto/README.md, section 11): ``InputHistory``, the last ``H`` input frames it committed (replayed to rebuild its
state), and a ``PendingChunk`` per chunk not acknowledged yet (sent again after the replay).

``H`` is the stream's history contract: ``welcome``'s ``history_frames`` for an ``exact`` stream (the frames that
determine its decoder state), ``left_context_frames`` for a ``window`` stream (the kept context is its whole state).
Memory per stream: ``H * C`` values of the stored dtype (codes as int16 where the codebook fits, else int32; latents
as float32 or bfloat16, as they travel): Qwen3-TTS 580 x 16 x 2 = 18,560 bytes, VoxCPM2 20 x 64 x 4 = 5,120 bytes,
plus the chunks not yet acknowledged (kept until their reply, for a resend on another sidecar).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``. Not thread-safe: its stream's
lock guards it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["InputHistory", "PendingChunk", "host_inputs"]

INT16_CODES_BELOW = 2 ** 15
"""Codes below this are kept as int16 (Qwen3-TTS: 2048), others as int32."""


def host_inputs(codes: Any, input_kind: str, codebook_size: int | None) -> tuple[torch.Tensor, Any]:
    """A host copy ``[C, n]`` of a chunk's inputs in the dtype the history keeps, and for CUDA inputs the event
    recorded after the copy (else None); the caller may reuse its buffer afterwards. CUDA inputs are copied into
    pinned memory without waiting: the copy is queued on the caller's current stream ahead of what the chunk's send
    queues there (its CUDA IPC copy and event), so it is complete once the sidecar has read the chunk; a move, which
    may read the copy sooner, waits for its event first."""
    tensor = codes.detach() if isinstance(codes, torch.Tensor) else torch.as_tensor(np.asarray(codes))  # [C, n]
    if input_kind == "latents":
        dtype = torch.bfloat16 if tensor.dtype == torch.bfloat16 else torch.float32
    else:
        dtype = torch.int16 if codebook_size is not None and codebook_size <= INT16_CODES_BELOW else torch.int32
    if not tensor.is_cuda:
        return tensor.to(device="cpu", dtype=dtype, copy=True).contiguous(), None  # [C, n]
    converted = tensor.to(dtype).contiguous()  # [C, n] on the device, queued
    host = torch.empty(converted.shape, dtype=dtype, pin_memory=True)  # [C, n]
    host.copy_(converted, non_blocking=True)
    copied = torch.cuda.Event()
    with torch.cuda.device(tensor.device):
        copied.record()  # (the current stream of the inputs' device: where the copy was queued)
    return host, copied


class InputHistory:
    """Up to ``max_frames`` most recent committed frames, and how many frames were committed in all."""

    def __init__(self, max_frames: int) -> None:
        if max_frames < 0:
            raise ValueError(f"max_frames must be >= 0, got {max_frames}")
        self.max_frames = max_frames
        self.total_frames = 0  # committed since the stream opened (a replay's start_frame is total - kept)
        self._parts: deque[torch.Tensor] = deque()  # [C, n] each, oldest first
        self._num_kept = 0

    @property
    def num_frames(self) -> int:
        """Frames kept (``min(total_frames, max_frames)``)."""
        return self._num_kept

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self._parts)

    @property
    def first_frame(self) -> int:
        """The index, in the stream, of the oldest frame kept."""
        return self.total_frames - self._num_kept

    def add(self, inputs: torch.Tensor) -> None:
        """A committed chunk's inputs ``[C, n]`` (a host copy of its own: kept as it is)."""
        num_frames = int(inputs.shape[1])
        self.total_frames += num_frames
        if self.max_frames == 0 or num_frames == 0:
            return
        if num_frames >= self.max_frames:
            self._parts.clear()
            self._parts.append(inputs[:, num_frames - self.max_frames:].clone())  # [C, H]
            self._num_kept = self.max_frames
            return
        self._parts.append(inputs)
        self._num_kept += num_frames
        while self._num_kept - int(self._parts[0].shape[1]) >= self.max_frames:
            self._num_kept -= int(self._parts.popleft().shape[1])
        excess = self._num_kept - self.max_frames
        if excess > 0:  # trim the oldest part to what is still needed
            self._parts[0] = self._parts[0][:, excess:].clone()  # [C, kept]
            self._num_kept -= excess

    def frames(self) -> torch.Tensor | None:
        """The kept frames ``[C, num_frames]`` in order, or None when nothing is kept."""
        if not self._parts:
            return None
        return torch.cat(list(self._parts), dim=1)  # [C, kept]


@dataclass(eq=False)
class PendingChunk:
    """A chunk the caller submitted whose audio has not reached it yet."""

    inputs: torch.Tensor  # host copy [C, n], in the history's dtype
    copied: Any  # for CUDA inputs, the event after their copy to ``inputs`` (None: on the host already)
    final: bool
    context_frames: int
    future: Future  # the caller's
    timeout_s: float | None
    audio: torch.Tensor | None = None  # its reply, while an earlier chunk's is still out
    done: bool = False
