"""Outgoing messages and the assembly of one ``DecodeResult`` from its chunks' outcomes.

A ``Decode`` message's chunks may finish in different engine steps; its reply goes out once every chunk has an
outcome, with each chunk's audio as its own zero-copy frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from code2wav import proto
from code2wav.proto import ErrorCode

from .metrics import Metrics


@dataclass
class Outbound:
    identity: bytes
    message: Any
    buffers: list = field(default_factory=list)
    stamps: list | None = None  # the traced chunks of the reply (chunk_trace.ChunkStamps; ``trace_chunks``)


class Outbox:
    """The messages a loop turn leaves to send, in order; typed errors among them are counted by code."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.messages: list[Outbound] = []

    def take(self) -> list[Outbound]:
        """The messages to send, in order; the outbox is empty afterwards."""
        messages, self.messages = self.messages, []
        return messages

    def send(self, identity: bytes, message: Any, buffers: list | None = None) -> None:
        self.messages.append(Outbound(identity, message, buffers or []))

    def error(self, identity: bytes, request_id: int | None, code: ErrorCode, message: str,
              failed_seq: int | None = None) -> None:
        """A message-level typed error to ``identity`` (``failed_seq``: a finish refused by a late failure)."""
        self.metrics.errors.labels(code=code.value).inc()
        self.send(identity, proto.Error(request_id=request_id, code=code, message=message, failed_seq=failed_seq))

    def reject(self, reply: PendingReply, index: int, stream_id: str, seq: int, code: ErrorCode,
               message: str, failed_seq: int | None = None) -> None:
        """One chunk of ``reply`` failed with a typed error (the rest of the reply is unaffected)."""
        self.metrics.errors.labels(code=code.value).inc()
        reply.reject(index, stream_id, seq, code, message, failed_seq)

    def emit_if_done(self, reply: PendingReply) -> None:
        """``reply`` goes out once every chunk of it has an outcome."""
        if reply.done:
            self.messages.append(reply.to_outbound())


@dataclass(eq=False)
class PendingReply:
    identity: bytes
    request_id: int
    num_chunks: int
    results: list = field(init=False)  # proto.ChunkResult (errors) or (stream_id, seq, num_frames, ipc) per chunk
    audio: list = field(init=False)  # Tensor | None per chunk
    remaining: int = field(init=False)
    stamps: list | None = field(default=None, init=False)  # its traced chunks' chunk_trace.ChunkStamps

    def __post_init__(self) -> None:
        self.results = [None] * self.num_chunks
        self.audio = [None] * self.num_chunks
        self.remaining = self.num_chunks

    @property
    def done(self) -> bool:
        """Every chunk has an outcome: the reply went out (``Outbox.emit_if_done`` runs in the same turn)."""
        return self.remaining == 0

    def reject(self, index: int, stream_id: str, seq: int, code: ErrorCode, message: str,
               failed_seq: int | None = None) -> None:
        self.results[index] = proto.ChunkResult(stream_id=stream_id, seq=seq, audio=None, num_frames=0,
                                                error=proto.ErrorInfo(code=code, message=message,
                                                                      failed_seq=failed_seq))
        self.remaining -= 1

    def unresolve(self, index: int) -> None:
        """Take back chunk ``index``'s outcome while the reply has not gone out (an early answer whose step then
        refused the chunk: it is rejected instead)."""
        assert not self.done and self.results[index] is not None
        self.results[index] = self.audio[index] = None
        self.remaining += 1

    def resolve(self, index: int, stream_id: str, seq: int, audio: Tensor, num_frames: int,
                ipc: tuple | None = None) -> None:
        """``ipc``: ``(audio_out descriptor, audio_event)`` when the audio was written into a client region."""
        self.audio[index] = audio
        self.results[index] = (stream_id, seq, num_frames, ipc)
        self.remaining -= 1

    def to_outbound(self) -> Outbound:
        results, buffers = [], []
        for entry, audio in zip(self.results, self.audio):
            if audio is None:
                results.append(entry)
                continue
            stream_id, seq, num_frames, ipc = entry
            if ipc is not None:  # already in the client's region: only the descriptor travels
                results.append(proto.ChunkResult(stream_id=stream_id, seq=seq, audio=ipc[0], num_frames=num_frames,
                                                 audio_event=ipc[1]))
                continue
            # (a resend of a chunk whose audio went to a region is answered inline from its host copy, store_audio)
            buffers.append(memoryview(audio.numpy()).cast("B"))  # contiguous float32 [n * U], sent without a copy
            desc = proto.TensorDesc(dtype="float32", shape=(audio.numel(),), loc=proto.InlineLoc(frame=len(buffers)))
            results.append(proto.ChunkResult(stream_id=stream_id, seq=seq, audio=desc, num_frames=num_frames))
        message = proto.DecodeResult(request_id=self.request_id, results=tuple(results))
        return Outbound(self.identity, message, buffers, self.stamps)
