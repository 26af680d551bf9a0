"""``StreamLedger``: one stream's sequence bookkeeping on the client (which seqs are out, which are in doubt).

Sequence numbers: ``next_seq`` is the seq the server expects next; it moves only when a chunk's audio arrives.
Chunks may be pipelined (several submitted before the first reply). A chunk whose outcome is unknown (the call
timed out or the server stopped answering) is *in doubt*: until a resend resolves it, new chunks are refused,
because sending the next seq could be read by the server as a resend of the doubtful one.

The ledger knows no sockets and no client: ``Stream`` reserves seqs in it, the sender hands back seqs it never
sent, and ``results`` records each chunk's outcome. Thread-safe (one lock per stream).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from ._call import Outcome
from .errors import InvalidArgument, NotFound, OutOfOrder, StreamLost

__all__ = ["SentChunk", "StreamLedger"]


@dataclass(eq=False)
class SentChunk:
    """A chunk the server has not acknowledged yet (kept for ``resend``)."""

    seq: int
    codes: Any  # the wire inputs: numpy array, or a CUDA tensor
    final: bool
    context_frames: int
    in_doubt: bool = False
    """The last attempt got no reply (or never left after one that got none): call resend()."""
    maybe_applied: bool = False
    """Some attempt was sent and got no reply: the server may have applied it."""

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[1])


class StreamLedger:
    def __init__(self, stream_id: str, is_lost: Callable[[], bool]) -> None:
        self.stream_id = stream_id
        self._is_lost = is_lost  # whether the server restarted since the stream was opened
        self._lock = threading.Lock()
        self._next_seq = 0
        self._send_seq = 0
        self._unacked: dict[int, SentChunk] = {}
        self._last_chunk: SentChunk | None = None
        self._closed_reason: str | None = None
        self._rewound_to: int | None = None  # a late refusal's seq: new chunks wait for one sent with that seq

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

    @property
    def num_unacked(self) -> int:
        return len(self._unacked)

    def check_usable(self) -> None:
        """Raise ``StreamLost`` or ``NotFound`` when the stream cannot take chunks."""
        if self._is_lost():
            raise StreamLost(
                f"stream {self.stream_id!r} is gone: the sidecar restarted after it was opened; open a new one"
            )
        if self._closed_reason is not None:
            raise NotFound(f"stream {self.stream_id!r} is closed ({self._closed_reason})")

    def reserve(self, codes: Any, final: bool, context_frames: int, seq: int | None = None) -> SentChunk:
        """The next seq for a new chunk (refused while a chunk is in doubt or a final one is in flight). ``seq``: the
        seq the caller means it to have (refused if it is not the next); after a late refusal (``rewind``) a chunk
        must name the refused seq: the caller may have submitted chunks meant to follow the refused one meanwhile."""
        with self._lock:
            self.check_usable()
            if self._rewound_to is not None and seq != self._rewound_to:
                raise OutOfOrder(
                    f"chunk seq={self._rewound_to} of stream {self.stream_id!r} was refused after its early audio "
                    f"reply (failed_seq), and the chunks sent after it with it: send seq {self._rewound_to} again "
                    f"first, naming it (decode(codes, seq={self._rewound_to}))"
                )
            if seq is not None and seq != self._send_seq:
                raise OutOfOrder(f"stream {self.stream_id!r} takes seq {self._send_seq} next, not {seq}")
            for chunk in self._unacked.values():
                if chunk.in_doubt:
                    raise OutOfOrder(
                        f"chunk seq={chunk.seq} of stream {self.stream_id!r} got no reply and may or may not "
                        "have been applied; call resend() (or abort()) before sending new chunks"
                    )
                if chunk.final:
                    raise InvalidArgument(f"stream {self.stream_id!r} already has a final chunk in flight")
            chunk = SentChunk(self._send_seq, codes, final, context_frames)
            self._send_seq += 1
            self._rewound_to = None
            self._unacked[chunk.seq] = chunk
            return chunk

    def take_resend_chunks(self) -> list[SentChunk]:
        """The chunks to send again: those in doubt, or else the last acknowledged one (same audio again)."""
        with self._lock:
            self.check_usable()
            doubtful = sorted((c for c in self._unacked.values() if c.in_doubt), key=lambda c: c.seq)
            if doubtful:
                for chunk in doubtful:
                    chunk.in_doubt = False  # in flight again
                return doubtful
            if self._last_chunk is not None and not self._unacked:
                return [self._last_chunk]
            raise InvalidArgument(f"stream {self.stream_id!r} has no chunk to resend")

    def chunk_ok(self, chunk: SentChunk) -> None:
        """The server committed ``chunk``."""
        with self._lock:
            if self._unacked.get(chunk.seq) is chunk:
                del self._unacked[chunk.seq]
            self._last_chunk = chunk
            self._next_seq = max(self._next_seq, chunk.seq + 1)
            self._send_seq = max(self._send_seq, self._next_seq)
            if chunk.final:
                self._closed_reason = "its final chunk was decoded"
                self._unacked.clear()

    def chunk_failed(self, chunk: SentChunk, outcome: Outcome) -> None:
        """``chunk`` got no audio: ``unknown`` (no reply: in doubt), ``rejected`` or ``not_sent`` (seq free)."""
        with self._lock:
            if self._unacked.get(chunk.seq) is not chunk:
                return
            if outcome == "unknown":
                chunk.in_doubt = chunk.maybe_applied = True
                return
            if outcome == "not_sent" and chunk.maybe_applied:
                chunk.in_doubt = True  # this attempt never left, but an earlier one may have been applied
                return
            del self._unacked[chunk.seq]  # the server said no, or never saw it: the seq is free again
            if chunk.seq >= self._next_seq:
                self._send_seq = min(self._send_seq, chunk.seq)

    def rewind(self, seq: int, told: SentChunk | None = None) -> None:
        """The server refused ``seq`` after answering it with early audio (proto/README.md section 5), as the refusal
        of ``told`` (or of a finish) says: the stream continues from ``seq``, which is free again, as after a direct
        refusal (a resend never replays it). Told to a chunk that is no longer unacknowledged, it is stale and
        changes nothing: an earlier rewind dropped that chunk (it told the same failure, or an earlier one), and
        ``seq`` may have been committed since. (A finish's refusal is never stale: it reaches the client before the
        reply of any chunk sent after it learned the failure.)"""
        with self._lock:
            if (told is not None and self._unacked.get(told.seq) is not told) or seq >= self._next_seq:
                return
            self._next_seq = self._send_seq = seq
            self._rewound_to = seq  # (``reserve``: the next chunk must name it)
            # the chunks sent after it are refused (their replies say so, or already did): none is in doubt or in
            # flight any more as far as new chunks go, a final one among them included
            self._unacked = {s: chunk for s, chunk in self._unacked.items() if s < seq}
            if self._last_chunk is not None and self._last_chunk.seq >= seq:
                self._last_chunk = None

    def mark_closed(self, reason: str) -> None:
        with self._lock:
            self._closed_reason = reason
            self._unacked.clear()
