"""Model registry: turn a ``--model`` spec into a loaded streaming decoder on a device.

A model exposes what the engine needs and nothing about sockets, sessions or metrics:
``forward_stream(codes, num_frames, state, start_positions)``, ``state_layout()``, ``zero_state(B)``
and the facts in ``LoadedModel``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .qwen3_tts import SAMPLE_RATE_HZ, SHIPPED, CheckpointError, Qwen3TTSDecoder, load_folder, random_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    module: Qwen3TTSDecoder
    num_quantizers: int
    codebook_size: int
    samples_per_frame: int
    sample_rate_hz: int
    device: torch.device
    dtype: torch.dtype
    source: str  # "random-weights" or the folder


def configure_cuda(allow_tf32: bool = False) -> None:
    """Process-wide CUDA math settings, set once at start-up by whoever owns the process (server, bench).

    TF32 off keeps float32 decoding within 1e-4 of the CPU reference. cuDNN benchmark mode stays off for
    eager work: eager batches come in many shapes, and timing algorithms for each new shape cost seconds per
    step on the H200 (measured); graph capture may turn it on for its static shapes (graphs.cudnn_benchmark)."""
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.backends.cudnn.benchmark = False


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine (use --device cpu or auto)")
    return device


def load_model(spec: str, device: torch.device, dtype: str = "float32", name: str | None = None,
               seed: int = 0) -> LoadedModel:
    """``spec``: ``default`` (shipped architecture, seeded random weights) or a ``speech_tokenizer/`` folder."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")
    if spec == "default":
        module, sample_rate_hz, source = random_model(SHIPPED, seed=seed), SAMPLE_RATE_HZ, "random-weights"
    else:
        folder = Path(spec)
        if not folder.is_dir():
            raise CheckpointError(f"--model {spec}: not a folder (give a speech_tokenizer/ folder or 'default')")
        module, sample_rate_hz = load_folder(folder)
        source = str(folder.resolve())
    module = module.to(device=device, dtype=DTYPES[dtype]).requires_grad_(False)
    cfg = module.cfg
    return LoadedModel(
        name=name or "qwen3-tts-12hz", module=module, num_quantizers=cfg.num_quantizers,
        codebook_size=cfg.codebook_size, samples_per_frame=cfg.samples_per_frame, sample_rate_hz=sample_rate_hz,
        device=device, dtype=DTYPES[dtype], source=source)
