"""``Stream``: the client's handle on one server-side stream (decoder state).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

Calls go down only: a ``Stream`` checks inputs against the model's contract (welcome), keeps its seqs in a
``StreamLedger`` (``ledger.py``: pipelining, chunks in doubt, resends) and sends through the client's ``Sender``
(``sender.py``), which owns the connection. Nothing here imports ``client`` or ``sender``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from code2wav.proto import Limits, Opened

from .errors import InvalidArgument, LimitExceeded, SidecarError
from .ledger import SentChunk, StreamLedger
from .wire_tensors import as_wire_codes, cuda_wire_codes

if TYPE_CHECKING:
    from .sender import Sender
    from .wire_tensors import CodesLike

__all__ = ["Stream", "SentChunk"]


class Stream:
    """One stream of a ``SidecarClient``; create it with ``client.open_stream(...)``. Thread-safe.

    ``decode``/``resend``/``finish``/``abort`` block; ``submit``/``submit_resend`` return a
    ``concurrent.futures.Future``. asyncio: ``await asyncio.wrap_future(stream.submit(codes))``.
    """

    def __init__(self, sender: Sender, opened: Opened, generation: int, input_kind: str = "codes",
                 input_dtypes: tuple[str, ...] = ("float32",), early_audio: bool = False) -> None:
        self.sender = sender
        self.generation = generation  # the server generation the stream was opened in
        self.stream_id: str = opened.stream_id
        self.model: str = opened.model
        self.mode: str = opened.mode
        self.left_context_frames: int = opened.left_context_frames
        self.samples_per_frame: int = opened.samples_per_frame
        self.num_quantizers: int = opened.num_quantizers  # the inputs' first dimension (Q codes, D latents)
        self.input_kind: str = input_kind  # welcome's contract: "codes" or "latents"
        self.input_dtypes: tuple[str, ...] = input_dtypes  # welcome's: the wire dtypes latents may travel in
        self.early_audio: bool = early_audio  # opened with early audio (proto/README.md section 5)
        self.ledger = StreamLedger(self.stream_id, lambda: self.lost)

    # ------------------------------------------------------------------ public

    @property
    def next_seq(self) -> int:
        """The seq the server expects next (chunks acknowledged so far)."""
        return self.ledger.next_seq

    @property
    def closed(self) -> bool:
        return self.ledger.closed_reason is not None

    @property
    def lost(self) -> bool:
        """True once the server restarted after this stream was opened."""
        return self.sender.generation != self.generation

    def submit(
        self, codes: CodesLike, final: bool = False, context_frames: int = 0, *, timeout_s: float | None = None,
        seq: int | None = None,
    ) -> Future[torch.Tensor]:
        """Send one chunk ``[Q, n]`` (codes) or ``[D, n]`` (latents); the future gives float32 audio
        ``[(n - context_frames) * U]``. Latents travel in their own dtype (float32, or bfloat16 when welcome's
        ``input_dtypes`` lists it; float64 as float32); one the model does not take is ``InvalidArgument`` here.

        Host codes give host audio; their memory is sent without a copy, so do not modify it until the future
        is done. CUDA codes give CUDA audio on the same device: by CUDA IPC when the sidecar shares the host and
        GPU (the audio is then a view into this client's audio region, valid until you free it; ``clone()`` it
        to keep it past ``client.close()``), else inline with a counted fallback (``client.ipc_stats``). The
        codes are copied in stream order on the current stream: the buffer may be reused in stream order at
        once, but keep the tensor unchanged until the future is done if you may call ``resend()``. The audio
        is ready in the order of that same stream (it waits on the sidecar's event, not the host): use it
        there, or synchronise that stream before using it elsewhere.

        ``seq``: the seq this chunk must have (``OutOfOrder`` if the stream takes another next). Needed once after
        a late refusal of an early-audio stream (``SidecarError.failed_seq`` F): new chunks are refused until one
        names F, so a chunk meant to follow the refused one never silently takes its place.
        """
        return self.sender.submit_new([(self, codes, final, context_frames)], timeout_s, "concat", seq=seq)

    def decode(
        self, codes: CodesLike, final: bool = False, context_frames: int = 0, *, timeout_s: float | None = None,
        seq: int | None = None,
    ) -> torch.Tensor:
        """Blocking ``submit``: returns the chunk's audio or raises a ``SidecarError``."""
        return self.sender.wait(self.submit(codes, final, context_frames, timeout_s=timeout_s, seq=seq), timeout_s)

    def submit_resend(self, *, timeout_s: float | None = None) -> Future[torch.Tensor]:
        """Send again, with the same seqs, the chunks whose outcome is unknown.

        The server answers a resend of its last seq with the same reply, so this is
        safe whether or not the lost attempt was applied. Several doubtful chunks
        are resent in one message and their audio is concatenated. With nothing in
        doubt it replays the last acknowledged chunk (same audio again).
        """
        return self.sender.submit_resend(self, timeout_s)

    def resend(self, *, timeout_s: float | None = None) -> torch.Tensor:
        return self.sender.wait(self.submit_resend(timeout_s=timeout_s), timeout_s)

    def submit_abort(self, *, timeout_s: float | None = None) -> Future[None]:
        """Non-blocking ``abort``: the future resolves when the server confirms."""
        return self.sender.submit_stream_op(self, "abort", timeout_s)

    def finish(self, *, timeout_s: float | None = None) -> None:
        """Close gracefully once queued chunks are done (no-op if the final chunk was decoded)."""
        if self.closed:
            return
        self.check_usable()
        self.sender.wait(self.sender.submit_stream_op(self, "finish", timeout_s), timeout_s)

    def abort(self, *, timeout_s: float | None = None) -> None:
        """Drop queued chunks and free the state now (no-op if closed or lost)."""
        if self.closed or self.lost:
            return
        self.sender.wait(self.sender.submit_stream_op(self, "abort", timeout_s), timeout_s)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.abort()
        except SidecarError:
            pass  # best effort: the server frees idle streams anyway

    def __repr__(self) -> str:
        state = "lost" if self.lost else (f"closed: {self.ledger.closed_reason}" if self.closed else "open")
        return f"Stream({self.stream_id!r}, mode={self.mode!r}, next_seq={self.next_seq}, {state})"

    # ------------------------------------------------------------------ used by the sender

    def check_usable(self) -> None:
        """Raise ``StreamLost`` or ``NotFound`` when this stream cannot take chunks."""
        self.ledger.check_usable()

    def wire_inputs(self, codes: CodesLike, final: bool, context_frames: int, limits: Limits) -> Any:
        """``codes`` in wire form, checked against this stream and the server's limits: CUDA codes stay on
        their device (sent by CUDA IPC, or inline; the audio comes back on the device either way)."""
        self.check_usable()
        latents = self.input_kind == "latents"
        if isinstance(codes, torch.Tensor) and codes.is_cuda:
            array: Any = cuda_wire_codes(codes, latents, self.input_dtypes)
        else:
            array = as_wire_codes(codes, latents, self.input_dtypes)
        num_channels, num_frames = (int(d) for d in array.shape)
        if num_channels != self.num_quantizers:
            what = "latent channels" if latents else "quantizers"
            raise InvalidArgument(f"{self.input_kind} have {num_channels} {what}; stream {self.stream_id!r} needs "
                                  f"{self.num_quantizers} ({self.input_kind} [{self.num_quantizers}, n])")
        if num_frames > limits.max_chunk_frames:
            raise LimitExceeded(f"chunk has {num_frames} frames; the limit is {limits.max_chunk_frames} "
                                "(max_chunk_frames)", "max_chunk_frames")
        if num_frames == 0 and not final:
            raise InvalidArgument("a chunk with 0 frames must be final")
        if not 0 <= context_frames <= num_frames:
            raise InvalidArgument(f"context_frames must be in [0, {num_frames}], got {context_frames}")
        return array
