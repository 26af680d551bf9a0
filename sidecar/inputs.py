"""A chunk's inputs as they arrive: inline inputs are checked and copied now; CUDA IPC inputs and an
``audio_out`` are looked up and bounds-checked now (metadata only), read and written later by the engine step.

What is valid comes from the model's contract (``LoadedModel.input``: codes or latents, channels, wire dtypes,
range). Sans-IO like ``sessions``: every problem is a ``ChunkRejected`` with a typed code, scoped to the chunk.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from code2wav import proto
from code2wav.proto import ErrorCode, ProtocolError

from .ipc.regions import RegionService
from .models import LoadedModel
from .jobs import ChunkJob, IpcAudioOut, IpcInputs
from .work import ChunkRejected

_NP_DTYPES = {d.name: np.dtype(d.name) for d in proto.WIRE_DTYPES if d.name != "bfloat16"}  # (numpy has none)


def read_chunk_inputs(model: LoadedModel, regions: RegionService, identity: bytes, job: ChunkJob, chunk: proto.Chunk,
                      frames: list) -> None:
    """Inline inputs: checked and copied now (``job.codes``). CUDA IPC inputs: bounds-checked now, read and
    checked by the engine step (``job.ipc_codes``). An ``audio_out`` is bounds-checked too."""
    spec = model.input
    desc = chunk.codes
    if desc.dtype not in spec.wire_dtypes:
        raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"{spec.kind} must be {'/'.join(spec.wire_dtypes)} of "
                            f"shape [{spec.channels}, n] for model '{model.name}', got {desc.dtype}")
    num_channels, num_frames = desc.shape
    if num_channels != spec.channels:
        what = "quantizers" if spec.is_integer else "latent channels"
        raise ChunkRejected(ErrorCode.INVALID_ARGUMENT,
                            f"{spec.kind} have {num_channels} {what}, model '{model.name}' needs "
                            f"{spec.channels} (shape [{spec.channels}, n])")
    if num_frames == 0:  # an empty final chunk: nothing to read, wherever it says the inputs are
        job.codes = torch.zeros((num_channels, 0), dtype=spec.host_dtype())
        return
    if chunk.audio_out is not None:
        if regions.device is None:  # (audio_out is always cuda_ipc) unsupported here, as for codes: not not_found
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, "audio_out: cuda_ipc tensors are not supported by "
                                "this sidecar (capabilities.cuda_ipc is false)")
        num_samples = proto.audio_num_samples(num_frames, chunk.context_frames, model.samples_per_frame)
        if chunk.audio_out.shape != (num_samples,):
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"audio_out has shape {list(chunk.audio_out.shape)}; "
                                f"this chunk gives [{num_samples}] samples")
        region = regions.lookup(identity, chunk.audio_out.loc, "write", "audio_out")
        job.audio_out = IpcAudioOut(region, regions.view(region, chunk.audio_out, "audio_out"), chunk.audio_out)
    if isinstance(desc.loc, proto.CudaIpcLoc):
        if regions.device is None:
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, "cuda_ipc tensors are not supported by this "
                                "sidecar (capabilities.cuda_ipc is false)")
        region = regions.lookup(identity, desc.loc, "read", "codes")
        num_events = len(region.opened.events)
        if chunk.codes_event >= num_events:
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"codes_event {chunk.codes_event} is not one of the "
                                f"{num_events} events registered with region {region.region_id}")
        armed = None
        if chunk.codes_token is not None:
            doorbells = region.opened.doorbells
            if doorbells is None:
                raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"codes_token: region {region.region_id} has no "
                                    "doorbells (its registration returned none); send codes_event alone")
            if job.stream.mode.keeps_inputs:
                raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"codes_token: a {job.stream.mode.name} stream keeps "
                                    "its inputs on the host, which a step armed on the GPU cannot read; send "
                                    "codes_event alone, or open the stream in exact mode")
            if not doorbells.released:  # once one of its waits was released, the region's chunks go by their event
                armed = doorbells.armed(chunk.codes_event, chunk.codes_token)
        job.ipc_codes = IpcInputs(region, regions.view(region, desc, "codes"), chunk.codes_event, armed)
        return
    job.codes = _inline_inputs(model, desc, frames)


def _inline_inputs(model: LoadedModel, desc: proto.TensorDesc, frames: list) -> Tensor:
    num_channels, num_frames = desc.shape
    try:
        view = proto.inline_view(desc, frames)
    except ProtocolError as exc:
        raise ChunkRejected(exc.code, exc.message) from None
    if desc.dtype == "bfloat16":  # numpy has no bfloat16: a bfloat16 is the top half of a float32, widened exactly
        bits = np.frombuffer(view, dtype="<u2").astype(np.uint32) << 16  # [C * n] (a copy)
        array = bits.view(np.float32).reshape(num_channels, num_frames)  # [C, n] float32 (latents only)
    else:
        array = np.frombuffer(view, dtype=_NP_DTYPES[desc.dtype].newbyteorder("<"))
        host = np.dtype(np.int64) if model.input.is_integer else np.dtype(np.float32)
        array = array.reshape(num_channels, num_frames).astype(host)  # [C, n] (copy: chunks are small)
    values = torch.from_numpy(array)
    problem = model.input.problem(values)
    if problem is not None:
        raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, problem)
    return values
