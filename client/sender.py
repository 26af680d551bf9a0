"""The sender: turns reserved chunks and stream operations into calls on the connection, and settles their futures.

Calls go down only: ``Stream`` (the public handle) -> ``StreamLedger`` (seqs) and ``Sender`` (messages) ->
``Connection`` (``_io``: the socket and its I/O thread). ``results`` settles a reply into audio or typed errors
and records each chunk's outcome in its stream's ledger. Nothing here imports ``client``, and ``stream`` only
for type checking: the sender reads a few of a stream's fields.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch

from code2wav.proto import (Abort, Aborted, Chunk, Decode, DecodeResult, Finish, Finished, Limits, ServerMessage,
                            encode)

from ._call import Call, Outcome
from ._io import Connection
from .call_trace import CallStamps, CallTrace
from .cuda_ipc.link import IpcLink
from .errors import DeadlineExceeded, Internal, InvalidArgument, LimitExceeded, SidecarError
from .ledger import SentChunk
from .results import Settle, settle_reply
from .wire_tensors import CodesLike, TensorTransport, host_wire

if TYPE_CHECKING:
    from .stream import Stream

__all__ = ["Sender", "set_result", "set_exception"]

WAIT_GRACE_S = 1.0
HEADER_NBYTES_PER_CHUNK = 256
"""Generous estimate of a chunk's header bytes, for the message-size check before sending."""


def set_result(future: Future[Any], value: Any) -> None:
    if not future.done():
        try:
            future.set_result(value)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled meanwhile


def set_exception(future: Future[Any], error: BaseException) -> None:
    if not future.done():
        try:
            future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass


class Sender:
    def __init__(self, conn: Connection, ipc: IpcLink, transport: TensorTransport, address: str,
                 timeout_s: float, limits: Callable[[], Limits], trace: CallTrace | None = None) -> None:
        self.conn = conn
        self.trace = trace  # stamps decode calls (bench --stages); None: off
        self.ipc = ipc
        self.transport = transport
        self.address = address
        self.timeout_s = timeout_s
        self._limits = limits  # the latest welcome's limits
        self._order_lock = threading.Lock()  # seq assignment and queueing happen in one order

    @property
    def generation(self) -> int:
        """The connection's server generation (it changes when the server restarts)."""
        return self.conn.generation

    def wait(self, future: Future[Any], timeout_s: float | None) -> Any:
        if self.conn.on_io_thread:
            raise RuntimeError("blocking call from a future callback (the client's I/O thread); use submit()")
        wait_s = (self.timeout_s if timeout_s is None else timeout_s) + WAIT_GRACE_S
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError:  # backstop: the I/O thread enforces deadlines itself
            raise DeadlineExceeded(f"no reply from {self.address} within {wait_s:g}s") from None

    def call(
        self,
        msg_frames: list[Any],
        request_id: int,
        timeout_s: float | None,
        on_reply: Callable[[ServerMessage, list[memoryview]], Any],
        future: Future[Any],
        generation: int | None = None,
        on_failure: Callable[[SidecarError, Outcome], None] | None = None,
        stamps: CallStamps | None = None,
    ) -> None:
        def reply(msg: ServerMessage, frames: list[memoryview]) -> None:
            set_result(future, on_reply(msg, frames))

        def failure(error: SidecarError, outcome: Outcome) -> None:
            if on_failure is not None:
                on_failure(error, outcome)
            else:
                set_exception(future, error)

        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        self.conn.submit(Call(request_id, msg_frames, timeout, reply, failure, generation=generation, stamps=stamps))

    def submit_stream_op(self, stream: Stream, op: Literal["finish", "abort"],
                         timeout_s: float | None) -> Future[None]:
        request_id = self.conn.next_request_id()
        msg = Finish(request_id, stream.stream_id) if op == "finish" else Abort(request_id, stream.stream_id)
        expected = Finished if op == "finish" else Aborted
        future: Future[None] = Future()

        def on_reply(reply: ServerMessage, _frames: list[memoryview]) -> None:
            if not isinstance(reply, expected):
                raise Internal(f"expected {expected.TYPE}, got {reply.TYPE}")
            stream.ledger.mark_closed("finished" if op == "finish" else "aborted")

        def on_failure(error: SidecarError, _outcome: Outcome) -> None:
            if error.failed_seq is not None:  # a finish refused: an early-answered chunk was refused after all
                stream.ledger.rewind(error.failed_seq)
            set_exception(future, error)

        self.call(encode(msg), request_id, timeout_s, on_reply, future, generation=stream.generation,
                  on_failure=on_failure)
        return future

    def submit_new(self, entries: Sequence[tuple[Stream, CodesLike, bool, int]], timeout_s: float | None,
                   settle: Settle, seq: int | None = None) -> Future[Any]:
        """One ``decode`` message of ``entries``; ``seq``: the seq the one entry must have (``Stream.submit``)."""
        limits = self._limits()
        if not entries:
            raise InvalidArgument("a batch needs at least one chunk")
        if len(entries) > limits.max_chunks_per_message:
            raise LimitExceeded(f"{len(entries)} chunks in one batch; the server's limit is "
                                f"{limits.max_chunks_per_message} (max_chunks_per_message)", "max_chunks_per_message")
        prepared = []
        nbytes = 0
        for stream, codes, final, context_frames in entries:
            if stream.sender is not self:
                raise InvalidArgument(f"stream {stream.stream_id!r} belongs to another client")
            prepared.append((stream, stream.wire_inputs(codes, final, context_frames, limits), final, context_frames))
            nbytes += prepared[-1][1].nbytes + HEADER_NBYTES_PER_CHUNK
        if nbytes > limits.max_message_bytes:  # counted as if inline: CUDA codes may fall back to it
            raise LimitExceeded(
                f"batch is about {nbytes} bytes; the server's limit is {limits.max_message_bytes} "
                "(max_message_bytes): split it", "max_message_bytes"
            )
        if self.ipc.enabled:  # export and register the regions once per session, outside the order lock
            for device in {array.device for _, array, _, _ in prepared if isinstance(array, torch.Tensor)}:
                self.ipc.ensure(device, self.timeout_s if timeout_s is None else timeout_s)
        with self._order_lock:
            planned: list[tuple[Stream, SentChunk]] = []
            try:
                for stream, array, final, context_frames in prepared:
                    planned.append((stream, stream.ledger.reserve(array, final, context_frames, seq)))
            except SidecarError:
                for stream, chunk in reversed(planned):  # nothing was sent: give the seqs back
                    stream.ledger.chunk_failed(chunk, "not_sent")
                raise
            return self._submit_chunks(planned, timeout_s, settle)

    def submit_resend(self, stream: Stream, timeout_s: float | None) -> Future[Any]:
        with self._order_lock:
            chunks = stream.ledger.take_resend_chunks()
            return self._submit_chunks([(stream, chunk) for chunk in chunks], timeout_s, "concat")

    def _submit_chunks(self, planned: list[tuple[Stream, SentChunk]], timeout_s: float | None,
                       settle: Settle) -> Future[Any]:
        """Send planned chunks as one ``decode`` message and settle one future from their outcomes."""
        request_id = self.conn.next_request_id()
        packed = self.ipc.pack(planned)
        chunks: list[Chunk] = []
        buffers: list[Any] = []
        for (stream, chunk), ipc in zip(planned, packed):
            if ipc is not None:
                chunks.append(Chunk(stream.stream_id, chunk.seq, ipc.codes, chunk.final, chunk.context_frames,
                                    codes_event=ipc.codes_event, audio_out=ipc.audio_out,
                                    codes_token=ipc.codes_token))
                continue
            desc, frames = self.transport.pack(host_wire(chunk.codes), first_frame=1 + len(buffers))
            buffers.extend(frames)
            chunks.append(Chunk(stream.stream_id, chunk.seq, desc, chunk.final, chunk.context_frames))
        future: Future[Any] = Future()

        def on_reply(msg: ServerMessage, frames: list[memoryview]) -> Any:
            if not isinstance(msg, DecodeResult) or len(msg.results) != len(planned):
                got = len(msg.results) if isinstance(msg, DecodeResult) else msg.TYPE
                raise Internal(f"expected {len(planned)} decode results, got {got}")
            return settle_reply(planned, msg.results, frames, packed, settle)

        def on_failure(error: SidecarError, outcome: Outcome) -> None:
            if outcome != "unknown":  # else the sidecar may still use the slots: they stay reserved
                for ipc in packed:
                    if ipc is not None:
                        ipc.channel.release(ipc, audio_used=False)
            for stream, chunk in planned:
                stream.ledger.chunk_failed(chunk, outcome)
            if settle == "list_with_exceptions":
                set_result(future, [error] * len(planned))
            else:
                set_exception(future, error)

        generation = planned[0][0].generation
        frames = encode(Decode(request_id, tuple(chunks)), buffers)
        stamps = None if self.trace is None else self.trace.open(tuple((s.stream_id, c.seq) for s, c in planned))
        self.call(frames, request_id, timeout_s, on_reply, future, generation, on_failure, stamps)
        return future
