"""Synthetic decoder inputs for the demo and the bench, by the model's input contract: seeded random codes
``[Q, T]`` (int64, uniform in ``[0, codebook_size)``) for a codes model such as Qwen3-TTS, or seeded standard
normal latents ``[D, T]`` (float32, std 1) for a latents model such as VoxCPM2's AudioVAE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

InputKind = Literal["codes", "latents"]


@dataclass(frozen=True)
class InputContract:
    """What one frame of decoder input is: ``channels`` is ``Q`` (codes) or ``D`` (latents)."""

    kind: InputKind
    channels: int
    codebook_size: int | None = None  # codes only

    def __post_init__(self) -> None:
        if self.kind not in ("codes", "latents"):
            raise ValueError(f"input kind must be 'codes' or 'latents', got {self.kind!r}")
        if self.channels < 1:
            raise ValueError(f"channels must be >= 1, got {self.channels}")
        if self.kind == "codes" and (self.codebook_size is None or self.codebook_size < 1):
            raise ValueError("a codes contract needs codebook_size >= 1")

    @classmethod
    def of(cls, model: Any) -> "InputContract":
        """From a model description: the sidecar's ``LoadedModel`` (its ``input`` spec), a welcome's ``ModelInfo``
        (``input_kind``, ``channels``) or a latents decoder module (``latent_dim``)."""
        spec = getattr(model, "input", None)
        if spec is not None and hasattr(spec, "kind"):  # code2wav.sidecar.models.LoadedModel
            return cls(spec.kind, int(spec.channels), int(spec.high) if spec.kind == "codes" else None)
        kind = getattr(model, "input_kind", None)
        if kind is not None:  # code2wav.proto.ModelInfo (welcome)
            return cls(kind, int(model.channels), int(model.codebook_size) if kind == "codes" else None)
        if getattr(model, "latent_dim", None) is not None:  # a latents decoder module
            return cls("latents", int(model.latent_dim))
        return cls("codes", int(model.num_quantizers), int(model.codebook_size))


def synthetic_inputs(contract: InputContract, num_frames: int, seed: int) -> torch.Tensor:
    """Seeded inputs for ``num_frames`` frames: codes ``[Q, T]`` int64 or latents ``[D, T]`` float32 (std 1)."""
    gen = torch.Generator().manual_seed(seed)
    if contract.kind == "codes":
        assert contract.codebook_size is not None  # checked by the contract
        return torch.randint(0, contract.codebook_size, (contract.channels, num_frames), generator=gen)  # [Q, T]
    return torch.randn((contract.channels, num_frames), generator=gen)  # [D, T]


def synthetic_batch(contract: InputContract, batch: int, num_frames: int, seed: int) -> torch.Tensor:
    """``batch`` rows of ``synthetic_inputs`` (row ``b`` seeded ``seed + b``): ``[B, Q|D, T]``."""
    return torch.stack([synthetic_inputs(contract, num_frames, seed + b) for b in range(batch)])
