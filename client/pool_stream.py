"""``PooledStream``: a pool's handle on one stream, which outlives the sidecar it was opened on.

It has the single client's ``Stream`` API (``submit``/``decode``/``resend``/``finish``/``abort``, futures) and
speaks through the current sidecar's ``Stream`` (``inner``). It keeps, on the host, the stream's last ``H`` input
frames (``history.InputHistory``) and every chunk not acknowledged yet. When the sidecar cannot go on with the
stream (``failover.sidecar_gone``: it died, restarted, or refused the chunk as shutting down) or announces a drain,
the stream *moves* (proto/README.md, section 11):

1. the pool re-opens it on a live sidecar (``open_stream`` with ``start_frame`` = the index of the first kept frame);
2. the kept frames are sent there as context frames (decoded into the state, no audio: the caller sees none);
3. the chunks not acknowledged are sent again, in order; the caller's futures get their audio from the new sidecar.

Chunks submitted meanwhile wait in order and go after. A drain moves the stream at a chunk boundary (no chunk in
flight) and aborts it on the old sidecar. The caller sees no error; the pool counts the move
(``failover.FailoverStats``) and logs it. No sidecar able to take it: every waiting chunk fails with ``StreamLost``,
as a stream of one sidecar does.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Protocol

import torch

from .errors import DeadlineExceeded, InvalidArgument, NotFound, SidecarError, StreamLost
from .failover import give_up_error, sidecar_gone
from .history import InputHistory, PendingChunk, host_inputs
from .pool_stream_ends import StreamEnds
from .sender import set_exception, set_result
from .stream import Stream

__all__ = ["PooledStream", "MoveHost"]

MAX_FAILED_REPLAYS = 3
"""Moves in a row whose replay a sidecar refused before the stream is given up (``StreamLost``)."""


class MoveHost(Protocol):
    """What a pooled stream needs from its pool (``SidecarPool`` implements it)."""

    def start_move(self, stream: PooledStream, reason: str, start_frame: int, replay: torch.Tensor | None,
                   on_done: Callable[[Stream | None, Any, BaseException | None], None]) -> None: ...

    def wait(self, future: Future, timeout_s: float | None) -> Any: ...

    def wait_s(self, timeout_s: float | None) -> float: ...


class PooledStream(StreamEnds):
    """One stream of a ``SidecarPool``; create it with ``pool.open_stream(...)``. Thread-safe."""

    def __init__(self, host: MoveHost, inner: Stream, member: Any, open_kwargs: dict[str, Any],
                 history_frames: int, codebook_size: int | None) -> None:
        self._host = host
        self._inner = inner
        self.member = member  # the pool member (sidecar) it lives on now
        self.open_kwargs = dict(open_kwargs)  # mode, left_context_frames, model, options: what a move re-opens with
        self.history = InputHistory(history_frames)
        self._codebook_size = codebook_size
        self._lock = threading.RLock()
        self._pending: deque[PendingChunk] = deque()
        self._in_doubt: list[PendingChunk] = []  # no reply (deadline): the caller resends or aborts
        self._moving: str | None = None  # the reason of the move under way
        self._move_wanted: str | None = None  # a drain asked for: moves at the next chunk boundary
        self._lost: StreamLost | None = None
        self._settled = threading.Event()  # no move under way (``finish`` waits for it)
        self._settled.set()
        self._aborted = False
        self._finishing = False  # ``finish`` runs: no drain move starts (it would leave a stream open elsewhere)
        self._resends: list[Future] = []  # chunks in doubt sent again by a move: ``submit_resend`` gives the last
        self._failed_replays = 0  # consecutive moves whose replay a sidecar refused (MAX_FAILED_REPLAYS: lost)
        self._num_acked = 0

    # ------------------------------------------------------------------ the single client's Stream, read-only
    @property
    def lock(self) -> threading.RLock:
        """Held while a chunk is reserved and sent (``pool_batch`` holds several, in one order)."""
        return self._lock

    @property
    def inner(self) -> Stream:
        """The sidecar's ``Stream`` it speaks through now (changes when it moves)."""
        return self._inner

    stream_id = property(lambda self: self._inner.stream_id)
    model = property(lambda self: self._inner.model)
    mode = property(lambda self: self._inner.mode)
    left_context_frames = property(lambda self: self._inner.left_context_frames)
    samples_per_frame = property(lambda self: self._inner.samples_per_frame)
    num_quantizers = property(lambda self: self._inner.num_quantizers)
    input_kind = property(lambda self: self._inner.input_kind)
    input_dtypes = property(lambda self: self._inner.input_dtypes)
    sender = property(lambda self: self._inner.sender)  # (its ``address``: the sidecar it lives on now)

    @property
    def next_seq(self) -> int:
        """Chunks acknowledged so far (a move does not reset it)."""
        return self._num_acked

    @property
    def closed(self) -> bool:
        return self._aborted or (self._moving is None and self._inner.closed)

    @property
    def lost(self) -> bool:
        """True once it lost its sidecar and no other could take it over."""
        return self._lost is not None

    def check_usable(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self.closed:
            raise NotFound(f"stream {self.stream_id!r} is closed")

    # ------------------------------------------------------------------ chunks
    def submit(self, codes: Any, final: bool = False, context_frames: int = 0, *,
               timeout_s: float | None = None) -> Future[torch.Tensor]:
        """As ``Stream.submit``; the chunk's inputs are also copied to the host (the history, and a resend on another
        sidecar), so a CUDA chunk costs one device-to-host copy more than on a single client (queued, not waited
        for: ``history.host_inputs``)."""
        with self._lock:
            chunk = self.reserve(codes, final, context_frames, timeout_s)
            if self._moving is None:
                try:
                    self.settle_with(chunk, self._inner, self._inner.submit(codes, final, context_frames,
                                                                             timeout_s=timeout_s))
                except SidecarError as exc:
                    if not sidecar_gone(exc):
                        self._pending.remove(chunk)
                        raise
                    self._start_move("failover", exc)  # its sidecar is gone and no chunk told us yet: move now
            return chunk.future

    def decode(self, codes: Any, final: bool = False, context_frames: int = 0, *,
               timeout_s: float | None = None) -> torch.Tensor:
        return self._host.wait(self.submit(codes, final, context_frames, timeout_s=timeout_s), timeout_s)

    def reserve(self, codes: Any, final: bool, context_frames: int, timeout_s: float | None) -> PendingChunk:
        """Check and queue a chunk (the caller holds the lock and sends it, or a move will)."""
        self.check_usable()
        if any(chunk.final for chunk in self._pending):
            raise InvalidArgument(f"stream {self.stream_id!r} already has a final chunk in flight")
        inputs, copied = host_inputs(codes, self.input_kind, self._codebook_size)  # [C, n]
        if inputs.dim() != 2 or inputs.shape[0] != self.num_quantizers:
            raise InvalidArgument(f"{self.input_kind} must be [{self.num_quantizers}, n], got {tuple(inputs.shape)}")
        if not 0 <= context_frames <= inputs.shape[1]:
            raise InvalidArgument(f"context_frames must be in [0, {inputs.shape[1]}], got {context_frames}")
        chunk = PendingChunk(inputs, copied, final, context_frames, Future(), timeout_s)
        self._pending.append(chunk)
        return chunk

    @property
    def sendable(self) -> bool:
        """Whether a new chunk goes to the current sidecar now (else it waits for a move)."""
        return self._moving is None and not self._inner.lost

    def settle_with(self, chunk: PendingChunk, inner: Stream, future: Future) -> None:
        future.add_done_callback(lambda done: self.settle(chunk, inner, done.result() if done.exception() is None
                                                          else None, done.exception()))

    def settle(self, chunk: PendingChunk, inner: Stream, audio: torch.Tensor | None,
               error: BaseException | None) -> None:
        """A chunk's reply from ``inner``: acknowledged chunks enter the history in order and their futures get the
        audio; a gone sidecar starts a move (the chunk stays, to be sent again); other errors go to the caller."""
        ready: list[PendingChunk] = []
        failed = None
        with self._lock:
            if inner is not self._inner or chunk not in self._pending:
                return  # a reply from a sidecar the stream left, or a chunk already settled
            if self._moving is not None:  # from the sidecar being left: the move's history was taken without this
                return  # chunk, which stays waiting and goes again to the new sidecar, whatever this reply said
            if error is None:
                if self._in_doubt:  # a later chunk was accepted: the sidecar had committed those in doubt
                    for doubtful in self._in_doubt:
                        self.history.add(doubtful.inputs)
                        self._num_acked += 1
                    self._in_doubt.clear()
                chunk.audio, chunk.done = audio, True
                while self._pending and self._pending[0].done:
                    ready.append(self._pending.popleft())
                    self.history.add(ready[-1].inputs)
                    self._num_acked += 1
                if (self._move_wanted and not self._pending and not self._in_doubt and self._moving is None
                        and not self.closed):
                    self._start_move(self._move_wanted, None)
            elif sidecar_gone(error) and not self._aborted:
                self._start_move("failover", error)
            else:
                self._pending.remove(chunk)
                if isinstance(error, DeadlineExceeded):
                    self._in_doubt.append(chunk)
                failed = chunk
        for done in ready:
            set_result(done.future, done.audio)
            done.audio = None
        if failed is not None:
            set_exception(failed.future, error)

    # ------------------------------------------------------------------ moves
    def request_move(self, reason: str) -> None:
        """The pool saw this stream's sidecar die (``failover``: move now) or drain (``drain``: at the next chunk
        boundary, i.e. now if no chunk is in flight)."""
        with self._lock:
            if self._moving is not None or self.closed or self._lost is not None:
                return
            if reason == "drain" and (self._finishing or self._in_doubt):
                return  # it closes where it is; or a chunk is in doubt there (a deadline): resent there first
            if reason == "failover" or not self._pending:
                self._start_move(reason, None)
            else:
                self._move_wanted = reason

    def _start_move(self, reason: str, cause: BaseException | None) -> None:
        """(Lock held.) Re-open elsewhere; ``_moved`` continues once the pool has a new sidecar's stream."""
        self._moving, self._move_wanted = reason, None
        self._settled.clear()
        if self._in_doubt and reason == "failover":  # no reply came (deadline), their sidecar is gone: they go
            for chunk in self._in_doubt:  # again, first; the callers' futures failed already: ``resend`` gives these
                chunk.future = Future()
            self._resends = [chunk.future for chunk in self._in_doubt]
            self._pending.extendleft(reversed(self._in_doubt))
            self._in_doubt = []
        for chunk in self._pending:  # CUDA chunks' host copies are read from now on
            if chunk.copied is not None:
                chunk.copied.synchronize()
        old = self._inner
        self._host.start_move(self, reason, self.history.first_frame, self.history.frames(),
                              lambda inner, member, error: self._moved(old, reason, inner, member, error, cause))

    def _moved(self, old: Stream, reason: str, inner: Stream | None, member: Any, error: BaseException | None,
               cause: BaseException | None) -> None:
        """The pool re-opened the stream and sent its history (``inner``), or could not (``error``): then a failover
        gives up (``StreamLost``), a drain stays on the draining sidecar, which still serves it (the monitor asks
        again at its next look, until the grace ends)."""
        if error is not None and (reason != "drain" or old.lost):
            return self._give_up(give_up_error(self.stream_id, error if cause is None else cause))
        with self._lock:
            if error is None and (self._aborted or self._lost is not None):
                inner.submit_abort()
            elif error is None:
                self._inner, self.member = inner, member
            self._moving = None
            self._settled.set()
            if not self._aborted and self._lost is None:
                self._send_pending(self._inner)
        if error is None and reason == "drain" and not old.lost and not old.closed:
            old.submit_abort()  # (best effort: its sidecar frees it at exit anyway)

    def _send_pending(self, inner: Stream) -> None:
        """(Lock held.) Send every waiting chunk to ``inner``, in order (after a move: right behind the replay)."""
        for chunk in list(self._pending):
            chunk.done, chunk.audio = False, None
            try:
                self.settle_with(chunk, inner, inner.submit(chunk.inputs, chunk.final, chunk.context_frames,
                                                            timeout_s=chunk.timeout_s))
            except SidecarError as exc:
                self.settle(chunk, inner, None, exc)

    def replay_failed(self, inner: Stream, error: BaseException) -> None:
        """A sidecar refused a piece of the replay the stream moved there with (e.g. busy, in a mass failover):
        the chunks sent behind it cannot be accepted there; the stream moves again, or after MAX_FAILED_REPLAYS
        such moves in a row is lost."""
        with self._lock:
            if inner is not self._inner or self._moving is not None or self._aborted or self._lost is not None:
                return
            self._failed_replays += 1
            if self._failed_replays < MAX_FAILED_REPLAYS:
                return self._start_move("failover", error)
        self._give_up(give_up_error(self.stream_id, error))

    def replayed(self) -> None:
        """The replay of the latest move was accepted whole."""
        with self._lock:
            self._failed_replays = 0

    def _give_up(self, error: StreamLost) -> None:
        with self._lock:
            self._lost, self._moving = error, None
            self._settled.set()
            failed = list(self._pending)
            self._pending.clear()
        for chunk in failed:
            set_exception(chunk.future, error)

    def __enter__(self) -> PooledStream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.abort()
        except SidecarError:
            pass

    def __repr__(self) -> str:
        state = "lost" if self.lost else ("closed" if self.closed else f"on {self.sender.address}")
        return f"PooledStream({self.stream_id!r}, mode={self.mode!r}, acked={self._num_acked}, {state})"
