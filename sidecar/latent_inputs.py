"""Server-side checks for float decoder inputs (latents ``[D, n]``) and per-stream open options.

For a latents family (VoxCPM2's AudioVAE) a chunk's ``codes`` descriptor carries float32/bfloat16 latents. These
helpers check a descriptor against the model's contract, read inline latents, reject NaN/Inf, and turn
``open_stream.options`` into the family's per-stream settings. Every problem is a ``ChunkRejected`` with
``invalid_argument``, scoped to the chunk or open request that sent it, naming the expected shape or option.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from code2wav import proto
from code2wav.proto import ErrorCode, ProtocolError

from .work import ChunkRejected

_TORCH_LATENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SR_COND_RANGE_HZ = (1, 1_000_000)


def check_latents_desc(desc: proto.TensorDesc, latent_dim: int, model_name: str) -> None:
    """A chunk's input descriptor holds latents ``[latent_dim, n]`` of a float dtype the wire allows."""
    if desc.dtype not in _TORCH_LATENT_DTYPES:
        raise ChunkRejected(ErrorCode.INVALID_ARGUMENT,
                            f"model '{model_name}' decodes float latents: expected float32 or bfloat16 "
                            f"[{latent_dim}, n], got {desc.dtype}")
    if len(desc.shape) != 2 or desc.shape[0] != latent_dim:
        raise ChunkRejected(ErrorCode.INVALID_ARGUMENT,
                            f"latents have shape {list(desc.shape)}; model '{model_name}' needs [{latent_dim}, n] "
                            f"(channels first, frames last)")


def check_finite(latents: Tensor, what: str = "latents") -> None:
    """Reject NaN and Inf (they would poison the stream's state for good). On a device tensor this syncs."""
    if latents.numel() and not bool(torch.isfinite(latents).all()):
        bad = latents[~torch.isfinite(latents)][0].item()
        raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"{what} contain a non-finite value ({bad}); "
                            f"send finite float32/bfloat16 values")


def inline_latents(desc: proto.TensorDesc, frames: list, latent_dim: int, model_name: str) -> Tensor:
    """Checked copy of an inline latents tensor: ``[D, n]`` in its wire dtype (float32 or bfloat16)."""
    check_latents_desc(desc, latent_dim, model_name)
    try:
        view = proto.inline_view(desc, frames)
    except ProtocolError as exc:
        raise ChunkRejected(exc.code, exc.message) from None
    raw = np.frombuffer(view, dtype="<u2" if desc.dtype == "bfloat16" else "<f4").copy()  # the copy: latents are small
    flat = torch.from_numpy(raw)
    if desc.dtype == "bfloat16":
        flat = flat.view(torch.int16).view(torch.bfloat16)  # same bits, reinterpreted
    latents = flat.reshape(desc.shape)  # [D, n]
    check_finite(latents)
    return latents


def stream_options(options: dict[str, Any], accepted: dict[str, type], model_name: str) -> dict[str, Any]:
    """Check ``open_stream.options`` against the options a model accepts (name -> Python type); unknown names
    and wrong types are refused, naming what the model accepts."""
    for key, value in options.items():
        if key not in accepted:
            offered = ", ".join(sorted(accepted)) or "none"
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"model '{model_name}' has no stream option {key!r} "
                                f"(its options: {offered})")
        if not isinstance(value, accepted[key]) or isinstance(value, bool):
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"stream option {key!r} must be "
                                f"{accepted[key].__name__}, got {type(value).__name__}")
    return dict(options)


def sr_cond_hz(options: dict[str, Any], default_hz: int, model_name: str) -> int:
    """The VoxCPM2 ``sr_cond`` stream option (a sample rate in Hz; not a bucket index), or ``default_hz``."""
    checked = stream_options(options, {"sr_cond": int}, model_name)
    value = checked.get("sr_cond", default_hz)
    low, high = SR_COND_RANGE_HZ
    if not low <= value <= high:
        raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"sr_cond {value} is not a sample rate in Hz "
                            f"(expected {low}..{high}, e.g. 16000 or 48000)")
    return value
