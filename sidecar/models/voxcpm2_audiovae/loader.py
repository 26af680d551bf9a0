"""Build a ``VoxCPM2AudioVAEDecoder`` from a VoxCPM2 model folder, or with seeded random weights.

A folder of this family holds ``config.json`` and ``audiovae.safetensors`` (preferred when present) or
``audiovae.pth`` (a torch pickle read with ``weights_only=True``: tensors and plain dicts only; its state dict is
under ``"state_dict"`` or at the top level). ``encoder.*`` tensors are skipped; weight norm (``weight_g`` /
``weight_v``, or ``parametrizations.weight.original0/1``) is folded in float32 at load time. Loading is strict:
the folded ``decoder.*`` key set must be exactly the model's, with the same shapes; errors name the tensors.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from ...state_store import slot_nbytes
from ..family import CheckpointError
from ..weights_file import check_weights_file
from ..streaming import CausalConv, CausalTransConv, flat_conv_names
from .blocks import DepthwiseResidualUnit
from .config import SHIPPED, AudioVAEConfig
from .model import VoxCPM2AudioVAEDecoder

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
CONFIG_KEY = "audio_vae_config"
WEIGHT_FILES = ("audiovae.safetensors", "audiovae.pth")  # in order of preference (upstream's order)
DECODER_PREFIX = "decoder."
SKIPPED_PREFIXES = ("encoder.",)
RANDOM_OUTPUT_GAIN = 0.1  # random weights: scale of the last conv, for a speech-like level
DEFAULT_SPEC = "voxcpm2-default"  # --model spec for the shipped architecture with seeded random weights
_NORM_PAIRS = (("weight_g", "weight_v"), ("parametrizations.weight.original0", "parametrizations.weight.original1"))


def is_family_folder(folder: str | Path) -> bool:
    """Recognise a VoxCPM2 folder: ``config.json`` beside an ``audiovae.safetensors``/``audiovae.pth``, or a
    ``config.json`` with an ``audio_vae_config`` object. Reads nothing heavier than the config."""
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        return False
    if any((folder / name).is_file() for name in WEIGHT_FILES):
        return True
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and CONFIG_KEY in raw


def read_config(folder: Path) -> AudioVAEConfig:
    """The decoder config from ``folder/config.json`` (``audio_vae_config``; absent or empty: all defaults)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a VoxCPM2 model folder holds config.json and audiovae.pth "
                              f"(or audiovae.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    section = raw.get(CONFIG_KEY) if isinstance(raw, dict) else None
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise CheckpointError(f"{path}: {CONFIG_KEY} must be a JSON object, got {type(section).__name__}")
    try:
        return AudioVAEConfig.model_validate(section)
    except ValueError as exc:
        raise CheckpointError(f"{path}: invalid {CONFIG_KEY} (known keys: "
                              f"{', '.join(AudioVAEConfig.model_fields)}): {exc}") from exc


def read_weights(folder: Path) -> tuple[dict[str, Tensor], Path]:
    """The file's flat ``{name: tensor}`` and the file read. ``encoder.*`` tensors are not read from a safetensors
    file; a ``.pth`` is memory-mapped, so its encoder tensors are never paged in."""
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            break
    else:
        raise CheckpointError(f"{folder}: neither {' nor '.join(WEIGHT_FILES)} found (the VAE weights of a VoxCPM2 "
                              f"model folder)")
    check_weights_file(path)
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys() if not key.startswith(SKIPPED_PREFIXES)}, path
    try:
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            obj = torch.load(str(path), map_location="cpu", weights_only=True)  # legacy (non-zip) file format
    except Exception as exc:  # weights_only refuses anything but tensors and plain containers
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: cannot read it as a tensors-only torch file ({first_line}); download it "
                              "again, or convert it to audiovae.safetensors") from exc
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()):
        raise CheckpointError(f"{path}: expected a state dict of named tensors (at the top level or under "
                              f"'state_dict')")
    return obj, path


def fold_decoder_state(tensors: dict[str, Tensor], source: str = "checkpoint") -> dict[str, Tensor]:
    """``decoder.*`` tensors without the prefix, weight norm folded in float32 (``torch._weight_norm``, the op
    upstream runs, dim 0: per output channel of a conv, per input channel of a transposed conv)."""
    raw = {k[len(DECODER_PREFIX):]: t for k, t in tensors.items()
           if k.startswith(DECODER_PREFIX) and not k.startswith(SKIPPED_PREFIXES)}
    folded: dict[str, Tensor] = {}
    used: set[str] = set()
    for g_name, v_name in _NORM_PAIRS:
        for key in [k for k in raw if k.endswith("." + g_name)]:
            prefix = key[: -len(g_name)]
            if prefix + v_name not in raw:
                raise CheckpointError(f"{source}: decoder.{key} has no matching decoder.{prefix}{v_name} "
                                      f"(weight-norm pair)")
            g, v = raw[key].float(), raw[prefix + v_name].float()
            folded[prefix + "weight"] = torch._weight_norm(v, g, 0)  # [v.shape]
            used.update((key, prefix + v_name))
    for key, t in raw.items():
        if key in used:
            continue
        if key.endswith(tuple(name for pair in _NORM_PAIRS for name in pair)):
            raise CheckpointError(f"{source}: decoder.{key} has no matching weight-norm partner")
        if key in folded:
            raise CheckpointError(f"{source}: decoder.{key} is stored both folded and as a weight-norm pair")
        folded[key] = t
    return folded


def load_state(model: VoxCPM2AudioVAEDecoder, tensors: dict[str, Tensor], source: str) -> None:
    """Strictly load a file's tensors (encoder ones skipped) into ``model``; errors name the tensors (by the file's
    names: the kit convs' ``.conv`` level is the module's alone, ``streaming.flat_conv_names``)."""
    state = fold_decoder_state(tensors, source)
    module_names = {flat: name for name, flat in flat_conv_names(model.decoder).items()}  # file name -> module's
    expected = {k[len(DECODER_PREFIX):]: t for k, t in model.checkpoint_state_dict().items()}  # file names
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = [f"decoder.{k}: file {tuple(t.shape)} vs model {tuple(expected[k].shape)}"
                   for k, t in state.items() if k in expected and t.shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} decoder tensors: "
                        + ", ".join("decoder." + k for k in missing[:10]) + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensors: "
                        + ", ".join("decoder." + k for k in unexpected[:10]) + (" ..." if len(unexpected) > 10 else ""))
    if wrong_shape:
        problems.append(f"shape mismatches: {'; '.join(wrong_shape[:10])}")
    if problems:
        raise CheckpointError(f"{source} does not match the audio_vae_config in config.json (another model's "
                              "weights, or another architecture's config?): " + " | ".join(problems)
                              + "; give the config.json and weights of one VoxCPM2 model folder")
    bounds = state["sr_bin_boundaries"]
    if bounds.dtype.is_floating_point or bounds.tolist() != list(model.cfg.sr_bin_boundaries or ()):
        raise CheckpointError(f"{source}: decoder.sr_bin_boundaries {bounds.tolist()} ({bounds.dtype}) differ from "
                              f"the config's {list(model.cfg.sr_bin_boundaries or ())}: the file does not belong to "
                              f"this config.json")
    state = {module_names.get(k, k): (t.to(torch.int32) if k == "sr_bin_boundaries" else t.float())
             for k, t in state.items()}
    model.decoder.load_state_dict(state, strict=True)


def load_folder(folder: str | Path) -> tuple[VoxCPM2AudioVAEDecoder, int]:
    """Strictly load ``folder`` in float32 on CPU; returns ``(model, sample_rate_hz)``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (give a VoxCPM2 model folder or '{DEFAULT_SPEC}')")
    cfg = read_config(folder)
    tensors, path = read_weights(folder)
    model = VoxCPM2AudioVAEDecoder(cfg)
    load_state(model, tensors, str(path))
    log.info("loaded VoxCPM2 AudioVAE decoder from %s: %d parameters, %d bytes per stream slot (fp32)",
             path, sum(p.numel() for p in model.parameters()), slot_nbytes(model.state_layout(), torch.float32))
    return model.eval(), cfg.out_sample_rate


def random_model(cfg: AudioVAEConfig = SHIPPED, seed: int = 0) -> VoxCPM2AudioVAEDecoder:
    """The architecture with seeded random (already folded) weights, float32 on CPU: audio is noise-like at a
    speech-like level (neither saturated nor silent) for latents of std 1. For tests and benchmarks only."""
    gen = torch.Generator().manual_seed(seed)
    model = VoxCPM2AudioVAEDecoder(cfg)
    with torch.no_grad():
        for name, param in model.decoder.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "alpha":
                param.copy_(torch.exp(0.4 * torch.randn(param.shape, generator=gen)))
            elif name.endswith("scale_embed.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias_embed.weight"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif leaf == "bias":
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
        for module in model.decoder.modules():  # weights scaled by fan-in
            if isinstance(module, CausalTransConv):
                fan_in = module.conv.in_channels * 2  # each output sample sees 2 input frames
            elif isinstance(module, CausalConv):
                fan_in = math.prod(module.conv.weight.shape[1:])
            else:
                continue
            weight = module.conv.weight
            weight.copy_(torch.randn(weight.shape, generator=gen) / math.sqrt(fan_in))
        for module in model.decoder.modules():  # small residual branches, so the stack neither explodes nor clips
            if isinstance(module, DepthwiseResidualUnit):
                module.block[3].conv.weight.mul_(0.3)
        model.decoder.model[-1].conv.weight.mul_(RANDOM_OUTPUT_GAIN)
    log.warning("RANDOM WEIGHTS: the VoxCPM2 AudioVAE decoder was built with seeded random weights (seed %d); "
                "audio is noise-like, for tests and benchmarks only. Pass --model FOLDER (a VoxCPM2 model folder) "
                "for real audio.", seed)
    return model.eval()

