"""``Stream``: the client's handle on one server-side stream (decoder state).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

Sequence numbers: ``next_seq`` is the seq the server expects next; it moves
only when a chunk's audio arrives. Chunks may be pipelined (several submitted
before the first reply). A chunk whose outcome is unknown (the call timed out
or the server stopped answering) is *in doubt*: until ``resend()`` resolves it,
new chunks are refused, because sending the next seq could be read by the
server as a resend of the doubtful one.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from code2wav.proto import Limits, Opened

from .errors import InvalidArgument, NotFound, OutOfOrder, SidecarError, StreamLost
from .transport import as_wire_inputs, cuda_wire_inputs

if TYPE_CHECKING:
    from ._io import Outcome
    from .client import SidecarClient
    from .transport import CodesLike

__all__ = ["Stream"]


@dataclass(eq=False)
class SentChunk:
    """A chunk the server has not acknowledged yet (kept for ``resend``)."""

    seq: int
    codes: np.ndarray
    final: bool
    context_frames: int
    in_doubt: bool = False
    """The last attempt got no reply (or never left after one that got none): call resend()."""
    maybe_applied: bool = False
    """Some attempt was sent and got no reply: the server may have applied it."""

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[1])


class Stream:
    """One stream of a ``SidecarClient``; create it with ``client.open_stream(...)``. Thread-safe.

    ``decode``/``resend``/``finish``/``abort`` block; ``submit``/``submit_resend`` return a
    ``concurrent.futures.Future``. asyncio: ``await asyncio.wrap_future(stream.submit(codes))``.
    """

    def __init__(self, client: SidecarClient, opened: Opened, generation: int) -> None:
        self._client = client
        self._generation = generation
        self.stream_id: str = opened.stream_id
        self.model: str = opened.model
        self.mode: str = opened.mode
        self.left_context_frames: int = opened.left_context_frames
        self.samples_per_frame: int = opened.samples_per_frame
        self.num_quantizers: int = opened.num_quantizers
        self._lock = threading.Lock()
        self._next_seq = 0
        self._send_seq = 0
        self._unacked: dict[int, SentChunk] = {}
        self._last_chunk: SentChunk | None = None
        self._closed_reason: str | None = None

    # ------------------------------------------------------------------ public

    @property
    def next_seq(self) -> int:
        """The seq the server expects next (chunks acknowledged so far)."""
        return self._next_seq

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def lost(self) -> bool:
        """True once the server restarted after this stream was opened."""
        return self._client._conn.generation != self._generation

    def submit(
        self, codes: CodesLike, final: bool = False, context_frames: int = 0, *, timeout_s: float | None = None
    ) -> Future[torch.Tensor]:
        """Send one chunk ``[Q, n]``; the future gives float32 audio ``[(n - context_frames) * U]``.

        Host codes give host audio; their memory is sent without a copy, so do not modify it until the future
        is done. CUDA codes give CUDA audio on the same device: by CUDA IPC when the sidecar shares the host and
        GPU (the audio is then a view into this client's audio region, valid until you free it; ``clone()`` it
        to keep it past ``client.close()``), else inline with a counted fallback (``client.ipc_stats``). The
        codes are copied in stream order on the current stream: the buffer may be reused in stream order at
        once, but keep the tensor unchanged until the future is done if you may call ``resend()``. The audio
        is ready in the order of that same stream (it waits on the sidecar's event, not the host): use it
        there, or synchronise that stream before using it elsewhere.
        """
        return self._client._submit_new([(self, codes, final, context_frames)], timeout_s, "concat")

    def decode(
        self, codes: CodesLike, final: bool = False, context_frames: int = 0, *, timeout_s: float | None = None
    ) -> torch.Tensor:
        """Blocking ``submit``: returns the chunk's audio or raises a ``SidecarError``."""
        return self._client._wait(self.submit(codes, final, context_frames, timeout_s=timeout_s), timeout_s)

    def submit_resend(self, *, timeout_s: float | None = None) -> Future[torch.Tensor]:
        """Send again, with the same seqs, the chunks whose outcome is unknown.

        The server answers a resend of its last seq with the same reply, so this is
        safe whether or not the lost attempt was applied. Several doubtful chunks
        are resent in one message and their audio is concatenated. With nothing in
        doubt it replays the last acknowledged chunk (same audio again).
        """
        return self._client._submit_resend(self, timeout_s)

    def resend(self, *, timeout_s: float | None = None) -> torch.Tensor:
        return self._client._wait(self.submit_resend(timeout_s=timeout_s), timeout_s)

    def finish(self, *, timeout_s: float | None = None) -> None:
        """Close gracefully once queued chunks are done (no-op if the final chunk was decoded)."""
        if self.closed:
            return
        self._check_usable()
        self._client._wait(self._client._submit_stream_op(self, "finish", timeout_s), timeout_s)

    def abort(self, *, timeout_s: float | None = None) -> None:
        """Drop queued chunks and free the state now (no-op if closed or lost)."""
        if self.closed or self.lost:
            return
        self._client._wait(self._client._submit_stream_op(self, "abort", timeout_s), timeout_s)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.abort()
        except SidecarError:
            pass  # best effort: the server frees idle streams anyway

    def __repr__(self) -> str:
        state = "lost" if self.lost else (f"closed: {self._closed_reason}" if self.closed else "open")
        return f"Stream({self.stream_id!r}, mode={self.mode!r}, next_seq={self._next_seq}, {state})"

    # ------------------------------------------------------------------ used by SidecarClient

    def _check_usable(self) -> None:
        if self.lost:
            raise StreamLost(
                f"stream {self.stream_id!r} is gone: the sidecar restarted after it was opened; open a new one"
            )
        if self._closed_reason is not None:
            raise NotFound(f"stream {self.stream_id!r} is closed ({self._closed_reason})")

    def _wire_codes(self, codes: CodesLike, final: bool, context_frames: int, limits: Limits) -> Any:
        """``codes`` in wire form, checked against this stream and the server's limits: CUDA codes stay on
        their device (sent by CUDA IPC, or inline; the audio comes back on the device either way)."""
        self._check_usable()
        # Integer codes [Q, n], or float latents [D, n] for a latents model (VoxCPM2); the server checks the kind.
        array: Any = cuda_wire_inputs(codes) if isinstance(codes, torch.Tensor) and codes.is_cuda else as_wire_inputs(codes)
        num_quantizers, num_frames = (int(d) for d in array.shape)
        if num_quantizers != self.num_quantizers:
            raise InvalidArgument(
                f"codes have {num_quantizers} quantizers; stream {self.stream_id!r} needs {self.num_quantizers}"
            )
        if num_frames > limits.max_chunk_frames:
            raise InvalidArgument(f"chunk has {num_frames} frames; the limit is {limits.max_chunk_frames}")
        if num_frames == 0 and not final:
            raise InvalidArgument("a chunk with 0 frames must be final")
        if not 0 <= context_frames <= num_frames:
            raise InvalidArgument(f"context_frames must be in [0, {num_frames}], got {context_frames}")
        return array

    def _reserve(self, codes: np.ndarray, final: bool, context_frames: int) -> SentChunk:
        with self._lock:
            self._check_usable()
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
            self._unacked[chunk.seq] = chunk
            return chunk

    def _take_resend_chunks(self) -> list[tuple[Stream, SentChunk]]:
        with self._lock:
            self._check_usable()
            doubtful = sorted((c for c in self._unacked.values() if c.in_doubt), key=lambda c: c.seq)
            if doubtful:
                for chunk in doubtful:
                    chunk.in_doubt = False  # in flight again
                return [(self, chunk) for chunk in doubtful]
            if self._last_chunk is not None and not self._unacked:
                return [(self, self._last_chunk)]
            raise InvalidArgument(f"stream {self.stream_id!r} has no chunk to resend")

    def _on_chunk_ok(self, chunk: SentChunk) -> None:
        with self._lock:
            if self._unacked.get(chunk.seq) is chunk:
                del self._unacked[chunk.seq]
            self._last_chunk = chunk
            self._next_seq = max(self._next_seq, chunk.seq + 1)
            self._send_seq = max(self._send_seq, self._next_seq)
            if chunk.final:
                self._closed_reason = "its final chunk was decoded"
                self._unacked.clear()

    def _on_chunk_failed(self, chunk: SentChunk, outcome: Outcome) -> None:
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

    def _mark_closed(self, reason: str) -> None:
        with self._lock:
            self._closed_reason = reason
            self._unacked.clear()
