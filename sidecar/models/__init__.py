"""Decoder families and loaded models: ``load_model`` turns a ``--model`` spec into a ``LoadedModel`` on a device.

The contract a family provides (``family.py``) is all the rest of the sidecar knows about a model; the
registry (``registry.py``) lists the families. Nothing outside this folder names a family.
"""

from __future__ import annotations

import torch

from .family import (CheckpointError, Contract, DecoderFamily, FamilyError, GraphBuckets, InputSpec, LoadedModel,
                     StateSpec, StreamBatch, StreamOption, state_specs)
from .registry import DTYPES, FAMILIES, default_specs, detect_family, load_model, register_family

__all__ = ["CheckpointError", "Contract", "DecoderFamily", "FamilyError", "GraphBuckets", "InputSpec",
           "LoadedModel", "StateSpec", "StreamBatch", "StreamOption", "state_specs", "DTYPES", "FAMILIES",
           "default_specs", "detect_family", "load_model", "register_family", "configure_cuda", "resolve_device"]


def configure_cuda(allow_tf32: bool = False) -> None:
    """Process-wide CUDA math settings, set once at start-up by whoever owns the process (server, bench).

    TF32 off keeps float32 decoding within 1e-4 of the CPU reference. cuDNN's benchmark mode stays off: eager
    batches come in many shapes, and timing algorithms for each new shape cost seconds per step on the H200
    (measured); the dense convs' forms are timed per shape by ``kernels.conv_choice.ConvChoice`` instead."""
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
