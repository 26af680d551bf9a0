"""Client -> server messages of wire protocol v1, each declared once (the CUDA IPC region messages: ``ipc.py``).

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing outside ``proto``. Each class
is a ``declare.message`` (or, nested, ``declare.record``): its ``wire`` fields give the parser (strict: an
unknown key is an error naming it), the encoder (``to_wire``) and the doc's field table; its ``rule`` methods
the checks that span fields. The table of all messages is ``messages.py``.
"""

from __future__ import annotations

from typing import Any

from ._check import invalid
from .constants import MAX_CODES_TOKEN, MAX_REGION_EVENTS, PROTOCOL_VERSION, STREAM_MODES
from .declare import message, record, rule, wire
from .errors import ProtocolError
from .tensors import CudaIpcLoc, InlineLoc, TensorDesc, TensorField, inline_view
from .wire_containers import ArrayOf, IntMap, KnownKeys, Nullable
from .wire_types import UINT64, Bool, Choice, Int, Str, Version

__all__ = ["Hello", "OpenStream", "Chunk", "Decode", "Finish", "Abort", "Ping", "Bye"]

MAX_STREAM_OPTIONS = 16
_REQUEST_ID = "chosen by the client, echoed in the reply"


@message("hello", sender="client")
class Hello:
    """First message of a connection. capabilities: ``cuda_ipc: bool``, ``gpu_uuid: str | None``,
    ``host_id: str | None`` (the kernel boot id: equal ids mean the same host)."""

    request_id: int = wire(UINT64, doc=_REQUEST_ID)
    version: int = wire(Version(PROTOCOL_VERSION), first=True,
                        doc="the client's protocol version, checked before anything else")
    client_id: str = wire(Str(), doc="free-form, for logs and metrics (e.g. `host:pid:random`)")
    capabilities: dict[str, Any] = wire(
        KnownKeys({"cuda_ipc": Bool(), "gpu_uuid": Nullable(Str()), "host_id": Nullable(Str())}),
        default_factory=dict,
        doc="what the client can do: `cuda_ipc`, its GPU's `gpu_uuid`, `host_id` the kernel boot id "
            "(`/proc/sys/kernel/random/boot_id`; CUDA IPC needs one host)")
    session_secret: str | None = wire(
        Nullable(Str()), default=None, omit_default=True,
        doc="the `session_secret` of this connection's last `welcome`; required to replace a session that still "
            "exists on this routing id (section 1, session owner)")


@message("open_stream", sender="client")
class OpenStream:
    """Open a stream; ``model=None`` means the server's default model."""

    request_id: int = wire(UINT64, doc=_REQUEST_ID)
    stream_id: str = wire(Str(), doc="unique among this client's open streams")
    model: str | None = wire(Nullable(Str()), default=None, doc="the model; nil: the server's `default_model`")
    mode: str = wire(Choice(STREAM_MODES), default="exact", doc="see section 5")
    left_context_frames: int = wire(
        Int(0, "max_left_context_frames"), default=0,
        doc="used in `window` mode only (ignored in `exact`); clients conventionally send 25 for window mode")
    options: dict[str, int] = wire(
        IntMap(MAX_STREAM_OPTIONS), default_factory=dict, omit_default=True,
        doc="the model's `stream_options` (welcome); an unknown name or a value outside the option's range is "
            "`invalid_argument` (the server checks); absent options take their default")
    start_frame: int = wire(
        Int(0), default=0, omit_default=True,
        doc="`exact` mode: the stream's first frame is taken to be frame `start_frame` of its utterance (ignored in "
            "`window`). A failover replay (section 11) sends the original index of its first replayed frame, so "
            "positions count as they did on the first sidecar")
    early_audio: bool = wire(
        Bool(), default=False, omit_default=True,
        doc="answer this stream's CUDA IPC audio when its step is launched, before its outcome is read (section "
            "5, early audio); only to a server whose `welcome.capabilities.early_audio` is true")


@record("chunk", sender="client")
class Chunk:
    """``codes`` is a tensor ``[C, n]`` (codes or latents, as the model's contract says); its first
    ``context_frames`` frames give no audio.

    CUDA IPC (see ``ipc.py``): ``codes_event`` names the event of the codes' region recorded after the
    codes were written (required for ``cuda_ipc`` codes, absent otherwise); ``audio_out`` asks the server
    to write the audio into a ``write`` region (float32 ``[(n - context_frames) * U]``).
    """

    stream_id: str = wire(Str(), doc="an open stream of this client")
    seq: int = wire(Int(0), doc="the stream's next seq (section 5); the first chunk of a stream has seq 0")
    codes: TensorDesc = wire(
        TensorField(),
        doc="the chunk's inputs `[C, n]`. The protocol accepts any wire dtype; the model's contract (welcome: "
            "`input_kind`, `input_dtypes`, `input_channels`, `input_range`) decides, per chunk (`invalid_argument` "
            "naming the dtypes and the shape): codes are integers `[Q, n]` in `input_range` (`[0, codebook_size)`), "
            "latents are finite `float32` or `bfloat16` `[D, n]` of magnitude at most 1e4, i.e. `-10000 <= v <= "
            "10000` (inline or `cuda_ipc`; NaN/inf and larger values refused: the bound keeps the decoder finite); "
            "`float16` is refused")
    final: bool = wire(Bool(), default=False, doc="the last chunk: the stream is freed after its reply")
    context_frames: int = wire(
        Int(0), default=0, doc="the first `context_frames` frames are decoded into the state but produce no audio")
    codes_event: int | None = wire(
        Nullable(Int(0, MAX_REGION_EVENTS - 1)), default=None, omit_default=True,
        doc="the index, among the events registered with the codes' region, of the event the client recorded "
            "after writing the codes")
    audio_out: TensorDesc | None = wire(
        Nullable(TensorField()), default=None, omit_default=True,
        doc="`[(n - context_frames) * U]` in a `write` region of this connection: the server writes the audio "
            "there instead of sending it")
    codes_token: int | None = wire(
        Nullable(Int(2, MAX_CODES_TOKEN)), default=None, omit_default=True,
        doc="an armed chunk (section 3, device-armed hand-off): the codes are ready once doorbell word "
            "`codes_event` of the codes' region reaches this even token, written by the client's GPU stream after "
            "the codes (then the event); the server queues the step behind that wait and looks at the event only "
            "for a region whose wait it released before")

    @property
    def num_frames(self) -> int:
        """``n``, the codec frames in this chunk (context frames included)."""
        return self.codes.shape[1]

    @rule("`codes` has rank 2 `[C, n]`, `C >= 1`, `n <= max_chunk_frames`; `n` may be 0 only when `final` is true "
          "(a pure \"close\" chunk); `context_frames <= n`.")
    def _codes_shape(self, path: str, limits: Any, frames: Any) -> None:
        shape = self.codes.shape
        if len(shape) != 2:
            invalid(f"{path}.codes must have rank 2 [num_quantizers, num_frames], got shape {list(shape)}")
        num_quantizers, num_frames = shape
        if num_quantizers < 1:
            invalid(f"{path}.codes has 0 quantizers")
        if num_frames > limits.max_chunk_frames:
            invalid(f"{path}.codes has {num_frames} frames; the limit is {limits.max_chunk_frames} (max_chunk_frames)")
        if num_frames == 0 and not self.final:
            invalid(f"{path}.codes has 0 frames; only a final chunk may be empty")
        if self.context_frames > num_frames:
            invalid(f"{path}.context_frames is {self.context_frames} but the chunk has only {num_frames} frames")

    @rule("`codes_event` is required when `codes` is `cuda_ipc` and forbidden when it is inline.")
    def _codes_event(self, path: str, limits: Any, frames: Any) -> None:
        if type(self.codes.loc) is InlineLoc:
            try:
                inline_view(self.codes, frames)
            except ProtocolError as exc:
                raise ProtocolError(exc.code, f"{path}.codes: {exc.message}") from None
            if self.codes_event is not None:
                invalid(f"{path}.codes_event is only allowed with cuda_ipc codes")
        elif self.codes_event is None:
            invalid(f"{path} is missing required key 'codes_event'")

    @rule("`codes_token` is even and only with `cuda_ipc` codes (`codes_event` then names its doorbell word).")
    def _codes_token(self, path: str, limits: Any, frames: Any) -> None:
        if self.codes_token is None:
            return
        if type(self.codes.loc) is InlineLoc:
            invalid(f"{path}.codes_token is only allowed with cuda_ipc codes")
        if self.codes_token % 2:
            invalid(f"{path}.codes_token must be even (the server releases a doorbell with the odd token + 1), got "
                    f"{self.codes_token}")

    @rule("`audio_out` is a `cuda_ipc` `float32` rank-1 descriptor.")
    def _audio_out(self, path: str, limits: Any, frames: Any) -> None:
        audio_out = self.audio_out
        if audio_out is None:
            return
        if not isinstance(audio_out.loc, CudaIpcLoc):
            invalid(f"{path}.audio_out must be a cuda_ipc descriptor (inline audio needs no audio_out)")
        if audio_out.dtype != "float32" or len(audio_out.shape) != 1:
            invalid(f"{path}.audio_out must be float32 [num_samples], got {audio_out.dtype} {list(audio_out.shape)}")


@message("decode", sender="client")
class Decode:
    """One or more chunks, of one or many streams, decoded in one round trip."""

    request_id: int = wire(UINT64, doc=_REQUEST_ID)
    chunks: tuple[Chunk, ...] = wire(
        ArrayOf(Chunk, "max_chunks_per_message"),
        doc="the chunks; several of one stream must have consecutive seqs in message order")

    @rule("`chunks` holds at least one chunk.")
    def _not_empty(self, path: str, limits: Any, frames: Any) -> None:
        if not self.chunks:
            invalid(f"{path}.chunks must hold at least one chunk")


@message("finish", sender="client")
class Finish:
    """Close a stream gracefully once its queued chunks are done."""

    request_id: int = wire(UINT64, doc=_REQUEST_ID)
    stream_id: str = wire(Str(), doc="an open stream of this client")


@message("abort", sender="client")
class Abort:
    """Drop a stream's queued chunks and free its state now."""

    request_id: int = wire(UINT64, doc=_REQUEST_ID)
    stream_id: str = wire(Str(), doc="an open stream of this client")


@message("ping", sender="client")
class Ping:
    """Heartbeat; answered with ``Pong`` (even before ``hello``)."""

    request_id: int = wire(UINT64, doc=_REQUEST_ID)


@message("bye", sender="client")
class Bye:
    """The client is going away; the server frees all its streams. No reply."""

    request_id: int = wire(UINT64, doc=_REQUEST_ID)
