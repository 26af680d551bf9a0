"""Streams: the per-request unit of state, and the rules of its lifecycle.

A stream belongs to one client connection and is named by the client's ``stream_id``. Rules (DESIGN.md):
- ``seq`` must be the next one; chunks may be pipelined (seq k+1 sent before k's reply).
- Commit after success: state (arena slot for ``exact``, the left-context codes for ``window``) and
  ``committed_seq`` advance only when a chunk's audio was produced. A failed chunk rolls the expected seq
  back to it and fails the stream's later queued chunks, so the client can resend from there.
- A resend of the last committed seq returns the same audio again without advancing.
- An ``open_stream`` repeated with the same parameters before the stream's first chunk is answered again
  (``opened``), like a resend: a client that lost the answer (timeout, restart race) may retry its id.
- ``final`` frees the stream after its reply; ``finish`` frees it once queued chunks are done; ``abort``
  drops queued chunks and frees it now; a stream idle past the TTL is reaped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .modes import StreamMode, get_mode


@dataclass(frozen=True)
class LateFailure:
    """A chunk answered with early audio whose step then refused it (its stream went back to ``seq``): every later
    chunk of the stream is refused with this ``code`` and ``message`` and ``failed_seq = seq``, until seq comes
    again."""

    seq: int
    code: Any  # proto.ErrorCode
    message: str


@dataclass(eq=False)
class ServedStream:
    client: bytes  # transport identity of the owning connection
    stream_id: str
    model: str
    mode: StreamMode  # (a wire name given here is turned into its mode)
    left_context_frames: int
    slot: int | None  # arena slot (stateful modes)
    last_active_s: float
    context_codes: Tensor | None = None  # kept by the mode (window: last left_context_frames inputs [C, <=L])
    options: dict[str, int] = field(default_factory=dict)  # the family's stream options, validated at open
    next_seq: int = 0  # the seq the next accepted chunk must carry
    committed_seq: int = -1
    last_audio: Tensor | None = None  # reply of committed_seq, for idempotent resend (on the host)
    last_audio_event: Any = None  # CUDA IPC audio: complete once ``last_audio``'s host copy is (None: it is)
    last_num_frames: int = 0
    num_pending: int = 0  # chunks queued or in the engine
    closing: str | None = None  # why the stream will close once num_pending reaches 0
    closed: bool = False
    finish_waiters: list[int] = field(default_factory=list)  # request ids of Finish messages waiting
    early_audio: bool = False  # CUDA IPC audio answered at launch (proto/README.md section 5, early audio)
    late_failure: LateFailure | None = None  # an early-answered chunk refused after its reply, until it is resent

    def __post_init__(self) -> None:
        if isinstance(self.mode, str):
            self.mode = get_mode(self.mode)

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.client, self.stream_id)


def is_repeat_open(stream: ServedStream, model: str, mode: StreamMode, left_context_frames: int,
                   options: dict[str, int], early_audio: bool = False) -> bool:
    """Whether an ``open_stream`` for ``stream``'s id repeats the one that opened it (same model, mode, left
    context and options) while the stream has taken no chunk yet and is not closing: then it is answered again
    instead of ``already_exists``."""
    return (stream.next_seq == 0 and stream.num_pending == 0 and stream.closing is None and not stream.closed
            and stream.model == model and stream.mode is mode and stream.left_context_frames == left_context_frames
            and stream.options == options and stream.early_audio == early_audio and stream.late_failure is None)


class SeqVerdict:
    ACCEPT = "accept"
    RESEND = "resend"
    REFUSE = "refuse"


def check_seq(stream: ServedStream, seq: int) -> tuple[str, str]:
    """``(verdict, reason)``: accept the next seq, resend the last committed one, or refuse with a reason."""
    if seq == stream.next_seq:
        return SeqVerdict.ACCEPT, ""
    if seq == stream.committed_seq and stream.num_pending == 0 and stream.last_audio is not None:
        return SeqVerdict.RESEND, ""
    if seq < stream.next_seq and seq > stream.committed_seq:
        return SeqVerdict.REFUSE, f"seq {seq} of stream '{stream.stream_id}' is still being decoded"
    return SeqVerdict.REFUSE, (f"stream '{stream.stream_id}' expected seq {stream.next_seq} "
                      f"(last committed {stream.committed_seq}), got {seq}")
