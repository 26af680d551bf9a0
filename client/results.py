"""What a ``decode_result`` means for each chunk: checked audio (host, or a CUDA view) or a typed error, and how
one future settles from several chunks' outcomes.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from code2wav.proto import ChunkResult, CudaIpcLoc, ProtocolError, audio_num_frames, audio_num_samples

from .cuda_ipc.channel import PackedChunk
from .errors import Internal, SidecarError, error_from
from .ledger import SentChunk
from .wire_tensors import audio_from_frames

if TYPE_CHECKING:
    from .stream import Stream

__all__ = ["Settle", "settle_reply", "settle_outcomes", "chunk_outcome"]

Settle = Literal["concat", "list", "list_with_exceptions"]


def settle_reply(planned: list[tuple[Stream, SentChunk]], results: tuple[ChunkResult, ...], frames: list[memoryview],
                 packed: list[PackedChunk | None], settle: Settle) -> Any:
    """Each chunk's outcome, then the future's value. Runs on the I/O thread, but in the stream order of the
    caller that sent CUDA IPC chunks: a concat of region views must come after the sidecar's writes."""
    outcomes = [chunk_outcome(s, c, r, frames, ipc) for (s, c), r, ipc in zip(planned, results, packed)]
    caller_stream = next((ipc.stream for ipc in packed if ipc is not None), None)
    if caller_stream is None:
        return settle_outcomes(outcomes, settle)
    with torch.cuda.stream(caller_stream):
        return settle_outcomes(outcomes, settle)


def settle_outcomes(outcomes: list[Any], settle: Settle) -> Any:
    if settle == "list_with_exceptions":
        return outcomes
    for outcome in outcomes:
        if isinstance(outcome, SidecarError):
            raise outcome
    if settle == "list":
        return outcomes
    return outcomes[0] if len(outcomes) == 1 else torch.cat(outcomes)


def chunk_outcome(stream: Stream, chunk: SentChunk, result: ChunkResult, frames: list[memoryview],
                  ipc: PackedChunk | None) -> torch.Tensor | SidecarError:
    outcome = _inline_outcome(stream, chunk, result, frames)
    in_region = (result.audio is not None and isinstance(result.audio.loc, CudaIpcLoc)
                 and not isinstance(outcome, SidecarError))
    if in_region and (ipc is None or result.audio.loc != ipc.audio_out.loc):
        outcome, in_region = Internal(f"stream {stream.stream_id!r} seq {chunk.seq}: audio placed in a region "
                                      "slot this client did not offer"), False
    if ipc is not None:  # early audio: the reply may have left before the step read the codes (channel.release)
        ipc.channel.release(ipc, audio_used=in_region,
                            audio_event=result.audio_event if in_region and stream.early_audio else None)
    if isinstance(outcome, SidecarError):
        return outcome
    if in_region:
        assert ipc is not None and result.audio_event is not None
        return ipc.channel.audio_tensor(ipc, result.audio_event)  # [num_samples] float32 on the GPU
    if isinstance(chunk.codes, torch.Tensor) and outcome is not None:
        return outcome.to(chunk.codes.device)  # CUDA codes in, CUDA audio out, whatever the path
    return outcome


def _inline_outcome(stream: Stream, chunk: SentChunk, result: ChunkResult,
                    frames: list[memoryview]) -> torch.Tensor | SidecarError | None:
    """Check the result against the chunk; the inline audio tensor, None for region audio, or the error."""
    if result.stream_id != stream.stream_id or result.seq != chunk.seq:
        stream.ledger.chunk_failed(chunk, "unknown")
        return Internal(f"result for {result.stream_id!r}/{result.seq} where "
                        f"{stream.stream_id!r}/{chunk.seq} was expected")
    if result.error is not None:
        failed_seq = result.error.failed_seq
        if failed_seq is not None and failed_seq < chunk.seq:  # an early-answered chunk was refused after all
            stream.ledger.rewind(failed_seq, chunk)
        stream.ledger.chunk_failed(chunk, "rejected")
        return error_from(result.error.code, result.error.message, failed_seq)
    stream.ledger.chunk_ok(chunk)  # the server committed the chunk
    assert result.audio is not None
    expected_frames = audio_num_frames(chunk.num_frames, chunk.context_frames)
    expected_samples = audio_num_samples(chunk.num_frames, chunk.context_frames, stream.samples_per_frame)
    if result.num_frames != expected_frames or result.audio.numel != expected_samples:
        return Internal(
            f"stream {stream.stream_id!r} seq {chunk.seq}: expected {expected_frames} frames / "
            f"{expected_samples} samples, got {result.num_frames} frames / {result.audio.numel} samples"
        )
    if isinstance(result.audio.loc, CudaIpcLoc):
        return None
    try:
        return audio_from_frames(result.audio, frames)
    except ProtocolError as exc:
        return Internal(f"stream {stream.stream_id!r} seq {chunk.seq}: {exc.message}")
