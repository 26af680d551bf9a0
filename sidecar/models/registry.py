"""The decoder families this sidecar serves, and turning a ``--model`` spec into a loaded ``LoadedModel``.

``FAMILIES`` is built from an explicit list (adding a family is one line here). Tests and plugins pass their
own tuple, e.g. ``register_family(FAMILIES, toy)``, which returns a new tuple: nothing is mutated at import
time. ``detect_family`` picks the family of a folder from its ``config.json`` keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Sequence

import torch

from .family import DecoderFamily, FamilyError, LoadedModel
from .qwen3_tts.family import QWEN3_TTS
from .voxcpm2_audiovae.family import VOXCPM2_AUDIOVAE

FAMILIES: tuple[DecoderFamily, ...] = (QWEN3_TTS, VOXCPM2_AUDIOVAE)
"""The built-in families; the first one also serves ``--model default``."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT_SUBFOLDERS = ("speech_tokenizer",)
"""Where a TTS checkpoint keeps its decoder: a root holding one of these is suggested by name."""


@dataclass(frozen=True)
class Chunking:
    """How a family's producer (its TTS talker, through vLLM-Omni) hands frames to the decoder: what ``demo`` and
    ``decode`` send by default. Every chunk is a whole number of ``patch_frames``."""

    first_chunk_frames: int
    chunk_frames: int
    patch_frames: int
    window_left_context_frames: int


# Qwen3-TTS through vLLM-Omni's Code2Wav stage: a 1-frame first chunk, then 25 (its deploy file), 25 frames of left
# context in window mode. VoxCPM2's talker: one 4-frame latent patch per step; window mode adds the decoder's 20
# frames of history (its graph buckets' window shape, 24 frames).
CHUNKING = MappingProxyType({QWEN3_TTS.name: Chunking(1, 25, 1, 25), VOXCPM2_AUDIOVAE.name: Chunking(4, 4, 4, 20)})
DEFAULT_CHUNKING = Chunking(1, 25, 1, 25)
"""A family this table does not know (a plugin's): vLLM-Omni's Code2Wav chunking, any chunk size."""


def chunking_of(family_name: str) -> Chunking:
    return CHUNKING.get(family_name, DEFAULT_CHUNKING)


def register_family(families: Sequence[DecoderFamily], family: DecoderFamily) -> tuple[DecoderFamily, ...]:
    """``families`` plus ``family`` (first, so its ``default`` serves ``--model default``); names must be unique."""
    if any(f.name == family.name for f in families):
        raise ValueError(f"a decoder family named {family.name!r} is already registered")
    return (family, *families)


def default_specs(families: Sequence[DecoderFamily] = FAMILIES) -> dict[str, DecoderFamily]:
    """``--model`` names of random-weights models: ``default`` (the first family) and each family's optional
    ``default_spec`` (e.g. ``voxcpm2-default``)."""
    specs = {getattr(f, "default_spec", None): f for f in reversed(families)}
    specs.pop(None, None)
    return {**specs, "default": families[0]} if families else specs


def detect_family(folder: Path, families: Sequence[DecoderFamily] = FAMILIES) -> DecoderFamily:
    """The family whose ``recognises`` accepts ``folder/config.json``; a clear error when none (or several) does."""
    path = Path(folder) / "config.json"
    inner = [Path(folder) / name for name in CHECKPOINT_SUBFOLDERS if (Path(folder) / name / "config.json").is_file()]
    if not path.is_file():
        if inner:
            raise FamilyError(f"{folder} is a checkpoint root; give its decoder folder: --model {inner[0]}")
        raise FamilyError(f"{path} not found: a model folder holds config.json and its weights")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise FamilyError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise FamilyError(f"{path} must hold a JSON object")
    matches = [f for f in families if f.recognises(config)]
    if not matches and inner:
        raise FamilyError(f"{folder} is a checkpoint root (its config.json is the TTS model's); give its decoder "
                          f"folder: --model {inner[0]}")
    if not matches:
        raise FamilyError(f"{folder}: config.json (keys {sorted(config)[:12]}) is no known decoder family; "
                          f"known: {[f.name for f in families]} (give a model folder of one of them, or 'default')")
    if len(matches) > 1:
        raise FamilyError(f"{folder}: config.json matches several families {[f.name for f in matches]}")
    return matches[0]


def family_of_spec(spec: str, families: Sequence[DecoderFamily] = FAMILIES) -> DecoderFamily:
    """The family a ``--model`` spec names (random-weights name or folder), reading only ``config.json``."""
    defaults = default_specs(families)
    if spec in defaults:
        return defaults[spec]
    if not Path(spec).is_dir():
        raise FamilyError(f"--model {spec}: no such folder (give a model folder, e.g. a TTS checkpoint's "
                          f"speech_tokenizer/, or one of {', '.join(sorted(defaults))} for random weights)")
    return detect_family(Path(spec), families)


def check_model_spec(spec: str, families: Sequence[DecoderFamily] = FAMILIES) -> str | None:
    """Why ``spec`` cannot be loaded, found without loading it (one line), or None."""
    try:
        family_of_spec(spec, families)
    except FamilyError as exc:
        return model_error(spec, exc)
    return None


def model_error(spec: str, exc: Exception) -> str:
    """A model's error as one line that starts with ``--model``."""
    text = str(exc)
    if text.startswith("--"):
        return text
    return f"--model {text}" if text.startswith(spec) else f"--model {spec}: {text}"


def load_model(spec: str, device: torch.device, dtype: str = "float32", name: str | None = None, seed: int = 0,
               families: Sequence[DecoderFamily] = FAMILIES, fused_kernels: bool = True) -> LoadedModel:
    """``spec``: ``default`` (the first family's shipped architecture, seeded random weights), a family's
    ``default_spec`` (that family's, e.g. ``voxcpm2-default``) or a model folder. ``fused_kernels``: on CUDA,
    the family's Triton kernels where it has them (``engine.fused_kernels``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")
    if not families:
        raise ValueError("no decoder families registered")
    defaults = default_specs(families)
    if spec in defaults:
        family = defaults[spec]
        module, contract = family.default(seed)
        source = "random-weights"
    else:
        folder = Path(spec)
        if not folder.is_dir():
            raise FamilyError(f"--model {spec}: not a folder (give a model folder or one of {sorted(defaults)})")
        family = detect_family(folder, families)
        module, contract = family.load(folder)
        source = str(folder.resolve())
    torch_dtype = DTYPES[dtype]
    mixed = {k: s.dtype for k, s in contract.state.items() if s.dtype not in (None, torch_dtype)}
    if mixed:
        raise FamilyError(f"family {family.name!r}: state entries {mixed} differ from the model dtype {dtype}; "
                          "the state arena stores one dtype")
    module = module.to(device=device, dtype=torch_dtype).requires_grad_(False)
    fused = family.use_fused_kernels(module, fused_kernels and torch.device(device).type == "cuda")
    return LoadedModel(name=name or family.default_model_name, family=family, module=module, contract=contract,
                     device=device, dtype=torch_dtype, source=source, fused_kernels=fused)
