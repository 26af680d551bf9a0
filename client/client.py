"""``SidecarClient``: connect to a code2wav sidecar, open streams, decode chunks.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

One API for threads and asyncio: every operation has a ``submit...`` form that
returns a ``concurrent.futures.Future`` (asyncio: ``await
asyncio.wrap_future(fut)``) and a blocking form that is ``submit(...).result()``.
A background I/O thread owns the socket (see ``_io.py``).

    with SidecarClient("ipc:///run/code2wav/sidecar.sock", timeout_s=30) as c:
        s = c.open_stream("req-1", mode="window", left_context_frames=25)
        wav = s.decode(codes)                      # float32 [(n - context) * U], on the codes' device
        wav = s.decode(last, final=True)           # frees the stream after replying
        outs = c.decode_batch([(s1, codes1), (s2, codes2, {"final": True})])
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Literal, Sequence, Union

import torch

from code2wav.proto import (
    DEFAULT_LEFT_CONTEXT_FRAMES,
    STREAM_MODES,
    Aborted,
    Abort,
    Chunk,
    Decode,
    DecodeResult,
    Finish,
    Finished,
    Limits,
    ModelInfo,
    Opened,
    OpenStream,
    Ping,
    Pong,
    ServerMessage,
    Welcome,
    encode,
)

from ._io import Call, Connection, Outcome
from .cuda_ipc.link import IpcLink
from .errors import DeadlineExceeded, Internal, InvalidArgument, SidecarError, Unavailable
from .results import Settle, settle_reply
from .stream import SentChunk, Stream
from .transport import CodesLike, InlineTransport, TensorTransport, host_id

__all__ = ["SidecarClient", "DEFAULT_ADDRESS", "BatchItem"]

DEFAULT_ADDRESS = "ipc:///run/code2wav/sidecar.sock"
_WAIT_GRACE_S = 1.0
_HEADER_NBYTES_PER_CHUNK = 256
"""Generous estimate of a chunk's header bytes, for the message-size check before sending."""

BatchItem = Union[tuple[Stream, CodesLike], tuple[Stream, CodesLike, dict[str, Any]]]


def _set_result(future: Future[Any], value: Any) -> None:
    if not future.done():
        try:
            future.set_result(value)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled meanwhile


def _set_exception(future: Future[Any], error: BaseException) -> None:
    if not future.done():
        try:
            future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass


class SidecarClient:
    """A connection to one sidecar. Thread-safe; use as a context manager or call ``close()``."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        client_id: str | None = None,
        curve_server_key: bytes | str | None = None,
        cuda_ipc: bool = True,
        ipc_codes_nbytes: int = 4 << 20,
        ipc_audio_nbytes: int = 64 << 20,
    ) -> None:
        """``curve_server_key``: the sidecar's CurveZMQ public key (Z85, 40 characters) when it listens on a
        non-loopback TCP address with CurveZMQ; the client then encrypts with a fresh keypair of its own.

        ``cuda_ipc``: send CUDA codes by CUDA IPC when the sidecar shares this host and GPU. Two device regions
        are allocated on the codes' GPU on first use (``ipc_codes_nbytes`` for codes in flight,
        ``ipc_audio_nbytes`` for audio views alive at once; 64 MiB holds about 350 s of 24 kHz audio)."""
        self.address = address
        self.timeout_s = float(timeout_s)
        self.client_id = client_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._transport: TensorTransport = InlineTransport()
        self._order_lock = threading.Lock()  # seq assignment and queueing happen in one order
        capabilities = {"cuda_ipc": bool(cuda_ipc), "gpu_uuid": None, "host_id": host_id()}
        routing_id = b"c2w-" + uuid.uuid4().bytes
        self._conn = Connection(address, self.client_id, routing_id, capabilities, curve_server_key)
        self._ipc = IpcLink(self._conn, bool(cuda_ipc), capabilities["host_id"], ipc_codes_nbytes, ipc_audio_nbytes)
        try:
            self._handshake(connect_timeout_s)
        except BaseException:
            self._conn.close()
            raise

    def _handshake(self, connect_timeout_s: float) -> None:
        future: Future[Welcome] = Future()
        call = self._conn.hello_call(
            connect_timeout_s,
            lambda welcome: _set_result(future, welcome),
            lambda error, _outcome: _set_exception(future, error),
        )
        self._conn.submit(call)
        try:
            future.result(connect_timeout_s + _WAIT_GRACE_S)
        except (DeadlineExceeded, Unavailable, concurrent.futures.TimeoutError) as exc:
            hint = ""
            if self.address.startswith("ipc://") and not os.path.exists(self.address[len("ipc://"):]):
                hint = f" (the socket file {self.address[len('ipc://'):]} does not exist)"
            raise Unavailable(
                f"no code2wav sidecar answered at {self.address} within {connect_timeout_s:g}s{hint}; "
                "start one with `code2wav-sidecar serve` or pass the address it listens on"
            ) from exc

    # ------------------------------------------------------------------ info

    @property
    def server_info(self) -> Welcome:
        """The latest ``welcome`` (refreshed after a server restart)."""
        welcome = self._conn.welcome
        assert welcome is not None  # the constructor's handshake succeeded
        return welcome

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        return self.server_info.models

    @property
    def limits(self) -> Limits:
        return self.server_info.limits

    @property
    def boot_epoch(self) -> str:
        return self.server_info.boot_epoch

    # ------------------------------------------------------------------ lifecycle

    @property
    def ipc_stats(self) -> dict[str, int]:
        """Chunks sent by CUDA IPC (``ipc_chunks``) and inline fallbacks by reason (``inline_fallback:*``)."""
        return dict(self._ipc.stats)

    def close(self) -> None:
        """Unregister CUDA IPC regions, say ``bye`` (the server frees this client's streams), stop the I/O
        thread, close the socket. CUDA audio views still alive keep their memory (see ``Stream.submit``)."""
        self._ipc.close()
        self._conn.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _wait(self, future: Future[Any], timeout_s: float | None) -> Any:
        if self._conn.on_io_thread:
            raise RuntimeError("blocking call from a future callback (the client's I/O thread); use submit()")
        wait_s = (self.timeout_s if timeout_s is None else timeout_s) + _WAIT_GRACE_S
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError:  # backstop: the I/O thread enforces deadlines itself
            raise DeadlineExceeded(f"no reply from {self.address} within {wait_s:g}s") from None

    def _call(
        self,
        msg_frames: list[Any],
        request_id: int,
        timeout_s: float | None,
        on_reply: Callable[[ServerMessage, list[memoryview]], Any],
        future: Future[Any],
        generation: int | None = None,
        on_failure: Callable[[SidecarError, Outcome], None] | None = None,
    ) -> None:
        def reply(msg: ServerMessage, frames: list[memoryview]) -> None:
            _set_result(future, on_reply(msg, frames))

        def failure(error: SidecarError, outcome: Outcome) -> None:
            if on_failure is not None:
                on_failure(error, outcome)
            else:
                _set_exception(future, error)

        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        self._conn.submit(Call(request_id, msg_frames, timeout, reply, failure, generation=generation))

    # ------------------------------------------------------------------ streams

    def submit_open_stream(
        self,
        stream_id: str,
        *,
        mode: str = "exact",
        left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES,
        model: str | None = None,
        timeout_s: float | None = None,
        sr_cond: int | None = None,
    ) -> Future[Stream]:
        """Open a stream. ``left_context_frames`` applies to ``window`` mode only. ``sr_cond``: VoxCPM2's
        sample-rate condition in Hz for the stream's life (None: the model's default; other models refuse it)."""
        if mode not in STREAM_MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(STREAM_MODES)}; got {mode!r}")
        limits = self.limits
        if not 0 <= left_context_frames <= limits.max_left_context_frames:
            raise InvalidArgument(
                f"left_context_frames must be in [0, {limits.max_left_context_frames}], got {left_context_frames}"
            )
        if not stream_id or len(stream_id.encode()) > limits.max_id_len:
            raise InvalidArgument(f"stream_id must be 1..{limits.max_id_len} UTF-8 bytes, got {stream_id!r}")
        request_id = self._conn.next_request_id()
        context = left_context_frames if mode == "window" else 0
        if sr_cond is not None and (isinstance(sr_cond, bool) or not isinstance(sr_cond, int) or sr_cond <= 0):
            raise InvalidArgument(f"sr_cond must be a sample rate in Hz (a positive int), got {sr_cond!r}")
        options = {} if sr_cond is None else {"sr_cond": sr_cond}
        frames = encode(OpenStream(request_id, stream_id, model, mode, context, options))
        future: Future[Stream] = Future()

        def on_reply(msg: ServerMessage, _frames: list[memoryview]) -> Stream:
            if not isinstance(msg, Opened) or msg.stream_id != stream_id:
                raise Internal(f"expected opened for {stream_id!r}, got {msg!r}")
            return Stream(self, msg, self._conn.generation)

        self._call(frames, request_id, timeout_s, on_reply, future)
        return future

    def open_stream(
        self,
        stream_id: str,
        *,
        mode: str = "exact",
        left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES,
        model: str | None = None,
        timeout_s: float | None = None,
        sr_cond: int | None = None,
    ) -> Stream:
        future = self.submit_open_stream(
            stream_id, mode=mode, left_context_frames=left_context_frames, model=model, timeout_s=timeout_s,
            sr_cond=sr_cond,
        )
        return self._wait(future, timeout_s)

    def _submit_stream_op(self, stream: Stream, op: Literal["finish", "abort"], timeout_s: float | None) -> Future[None]:
        request_id = self._conn.next_request_id()
        msg = Finish(request_id, stream.stream_id) if op == "finish" else Abort(request_id, stream.stream_id)
        expected = Finished if op == "finish" else Aborted
        future: Future[None] = Future()

        def on_reply(reply: ServerMessage, _frames: list[memoryview]) -> None:
            if not isinstance(reply, expected):
                raise Internal(f"expected {expected.TYPE}, got {reply.TYPE}")
            stream._mark_closed("finished" if op == "finish" else "aborted")

        self._call(encode(msg), request_id, timeout_s, on_reply, future, generation=stream._generation)
        return future

    def ping(self, *, timeout_s: float | None = None) -> float:
        """Round trip to the server; returns seconds."""
        request_id = self._conn.next_request_id()
        future: Future[float] = Future()
        start = time.perf_counter()

        def on_reply(msg: ServerMessage, _frames: list[memoryview]) -> float:
            if not isinstance(msg, Pong):
                raise Internal(f"expected pong, got {msg.TYPE}")
            return time.perf_counter() - start

        self._call(encode(Ping(request_id)), request_id, timeout_s, on_reply, future)
        return self._wait(future, timeout_s)

    # ------------------------------------------------------------------ decode

    def submit_batch(
        self, items: Sequence[BatchItem], *, return_exceptions: bool = False, timeout_s: float | None = None
    ) -> Future[list[Any]]:
        """Send chunks of many streams in ONE ``decode`` message; the future gives audio tensors in order.

        Each item is ``(stream, codes)`` or ``(stream, codes, {"final": bool, "context_frames": int})``.
        If a chunk fails, the future raises the first error once all results are in (the other
        chunks' streams advance normally); with ``return_exceptions=True`` it gives a list where
        failed entries are ``SidecarError`` instances.
        """
        entries: list[tuple[Stream, CodesLike, bool, int]] = []
        for item in items:
            options: dict[str, Any] = item[2] if len(item) == 3 else {}  # type: ignore[misc]
            unknown = set(options) - {"final", "context_frames"}
            if unknown:
                raise InvalidArgument(f"unknown chunk options {sorted(unknown)} (allowed: final, context_frames)")
            entries.append((item[0], item[1], bool(options.get("final", False)), int(options.get("context_frames", 0))))
        return self._submit_new(entries, timeout_s, "list_with_exceptions" if return_exceptions else "list")

    def decode_batch(
        self, items: Sequence[BatchItem], *, return_exceptions: bool = False, timeout_s: float | None = None
    ) -> list[Any]:
        return self._wait(self.submit_batch(items, return_exceptions=return_exceptions, timeout_s=timeout_s), timeout_s)

    def _submit_new(
        self, entries: Sequence[tuple[Stream, CodesLike, bool, int]], timeout_s: float | None, settle: Settle
    ) -> Future[Any]:
        limits = self.limits
        if not entries:
            raise InvalidArgument("a batch needs at least one chunk")
        if len(entries) > limits.max_chunks_per_message:
            raise InvalidArgument(
                f"{len(entries)} chunks in one batch; the server's limit is {limits.max_chunks_per_message}"
            )
        prepared = []
        nbytes = 0
        for stream, codes, final, context_frames in entries:
            if stream._client is not self:
                raise InvalidArgument(f"stream {stream.stream_id!r} belongs to another client")
            prepared.append((stream, stream._wire_codes(codes, final, context_frames, limits), final, context_frames))
            nbytes += prepared[-1][1].nbytes + _HEADER_NBYTES_PER_CHUNK
        if nbytes > limits.max_message_bytes:  # counted as if inline: CUDA codes may fall back to it
            raise InvalidArgument(
                f"batch is about {nbytes} bytes; the server's limit is {limits.max_message_bytes}: split it"
            )
        if self._ipc.enabled:  # export and register the regions once per session, outside the order lock
            for device in {array.device for _, array, _, _ in prepared if isinstance(array, torch.Tensor)}:
                self._ipc.ensure(device, self.timeout_s if timeout_s is None else timeout_s)
        with self._order_lock:
            planned: list[tuple[Stream, SentChunk]] = []
            try:
                for stream, array, final, context_frames in prepared:
                    planned.append((stream, stream._reserve(array, final, context_frames)))
            except SidecarError:
                for stream, chunk in reversed(planned):  # nothing was sent: give the seqs back
                    stream._on_chunk_failed(chunk, "not_sent")
                raise
            return self._submit_chunks(planned, timeout_s, settle)

    def _submit_resend(self, stream: Stream, timeout_s: float | None) -> Future[Any]:
        with self._order_lock:
            return self._submit_chunks(stream._take_resend_chunks(), timeout_s, "concat")

    def _submit_chunks(self, planned: list[tuple[Stream, SentChunk]], timeout_s: float | None,
                       settle: Settle) -> Future[Any]:
        """Send planned chunks as one ``decode`` message and settle one future from their outcomes."""
        request_id = self._conn.next_request_id()
        packed = self._ipc.pack(planned)
        chunks: list[Chunk] = []
        buffers: list[Any] = []
        for (stream, chunk), ipc in zip(planned, packed):
            if ipc is not None:
                chunks.append(Chunk(stream.stream_id, chunk.seq, ipc.codes, chunk.final, chunk.context_frames,
                                    codes_event=ipc.codes_event, audio_out=ipc.audio_out))
                continue
            codes = chunk.codes.cpu().numpy() if isinstance(chunk.codes, torch.Tensor) else chunk.codes
            desc, frames = self._transport.pack(codes, first_frame=1 + len(buffers))
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
                stream._on_chunk_failed(chunk, outcome)
            if settle == "list_with_exceptions":
                _set_result(future, [error] * len(planned))
            else:
                _set_exception(future, error)

        generation = planned[0][0]._generation
        frames = encode(Decode(request_id, tuple(chunks)), buffers)
        self._call(frames, request_id, timeout_s, on_reply, future, generation, on_failure)
        return future
