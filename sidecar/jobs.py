"""A queued chunk (``ChunkJob``) and where its inputs and audio live when they stay on the device (CUDA IPC)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from code2wav import proto

from .streams import ServedStream

if TYPE_CHECKING:
    from .ipc.doorbells import ArmedInputs
    from .ipc.regions import Region


@dataclass(frozen=True)
class IpcInputs:
    """A chunk's inputs still in a client's CUDA IPC region: read by the engine step once the client's event is
    complete, or, armed, once its doorbell word reached the token (a wait on the GPU)."""

    region: Region
    view: Tensor  # [C, n] on the device, in the wire dtype
    event_index: int  # the client's event (of ``region``) recorded after it wrote the inputs
    armed: ArmedInputs | None = None  # an armed chunk: its doorbell word and token (the event is not looked at)


@dataclass(frozen=True)
class IpcAudioOut:
    """Where a chunk's audio goes: a view of a client's CUDA IPC region, and the descriptor the reply names."""

    region: Region
    view: Tensor  # [num_samples] float32 on the device
    desc: proto.TensorDesc


@dataclass(eq=False)
class ChunkJob:
    stream: ServedStream
    seq: int
    codes: Any  # Tensor [C, n] on the host: int64 codes or float32 latents (None while in a region: ipc_codes)
    context_frames: int
    final: bool
    arrived_s: float
    reply: Any  # the PendingReply this chunk's result belongs to
    index: int  # position of this chunk's result in the reply
    ipc_codes: IpcInputs | None = None  # inputs still in the client's region
    audio_out: IpcAudioOut | None = None  # write the audio there
    audio_event: int | None = None  # set by the engine step: the region event recorded after writing
    kept_event: Any = None  # CUDA IPC audio: the event after the host copy kept for a resend (``store_audio``)
    kept_audio: Tensor | None = None  # early audio: that host copy, taken when the outcome is read
    answered: bool = False  # its reply slot was resolved at its step's launch (early audio), before its outcome
    stamps: Any = None  # chunk_trace.ChunkStamps of a traced chunk (``trace_chunks``), else None

    @property
    def regions(self) -> list[Region]:
        """The CUDA IPC regions this chunk reads or writes (each holds one use per chunk)."""
        return [use.region for use in (self.ipc_codes, self.audio_out) if use is not None]

    @property
    def num_frames(self) -> int:
        """The chunk's own frames (its inputs may still be in a CUDA IPC region)."""
        return (self.codes if self.ipc_codes is None else self.ipc_codes.view).shape[1]

    @property
    def decoded_frames(self) -> int:
        """Frames the engine decodes for this chunk: its own after what its stream's mode keeps ahead of them."""
        return self.stream.mode.decoded_frames(self.stream, self.num_frames)

    @property
    def batch_key(self) -> tuple[str, str]:
        return (self.stream.model, self.stream.mode.name)
