"""Build a ``Qwen3TTSDecoder`` from a ``speech_tokenizer/`` folder, or with seeded random weights.

Loading is strict: every decoder tensor of the module must be in the file with the right shape, and every
``decoder.*`` tensor of the file must belong to the module; ``encoder.*`` tensors are skipped. Errors name
the offending tensors.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open

from ..family import CheckpointError
from ..weights_file import check_weights_file
from .blocks import DenseResidualUnit
from .config import DecoderConfig, SHIPPED
from .decoder import Qwen3TTSDecoder

log = logging.getLogger(__name__)

DECODER_PREFIX = "decoder."
SKIPPED_PREFIXES = ("encoder.",)
RANDOM_OUTPUT_GAIN = 0.1


def read_config(folder: Path) -> tuple[DecoderConfig, int]:
    """``(decoder config, output sample rate)`` from ``folder/config.json``."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a speech_tokenizer folder holds config.json and model.safetensors")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if "decoder_config" not in raw:
        raise CheckpointError(f"{path} has no 'decoder_config' (is this the speech_tokenizer folder?)")
    try:
        cfg = DecoderConfig.from_checkpoint_dict(raw["decoder_config"])
    except ValueError as exc:
        raise CheckpointError(f"{path}: invalid decoder_config: {exc}") from exc
    declared = raw.get("decode_upsample_rate")
    if declared is not None and declared != cfg.samples_per_frame:
        raise CheckpointError(
            f"{path}: decode_upsample_rate {declared} disagrees with the decoder_config's upsampling "
            f"({cfg.samples_per_frame} samples per frame)")
    return cfg, int(raw.get("output_sample_rate", 24000))


def load_folder(folder: str | Path) -> tuple[Qwen3TTSDecoder, int]:
    """Strictly load ``folder`` in float32 on CPU; returns ``(model, sample_rate_hz)``."""
    folder = Path(folder)
    cfg, sample_rate_hz = read_config(folder)
    weights_path = folder / "model.safetensors"
    if not weights_path.is_file():
        raise CheckpointError(f"{weights_path} not found: a speech_tokenizer folder holds config.json and "
                              "model.safetensors (download the whole folder)")
    check_weights_file(weights_path)
    model = Qwen3TTSDecoder(cfg)
    expected = {DECODER_PREFIX + k: v for k, v in model.decoder.state_dict().items()}
    found: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            if key.startswith(SKIPPED_PREFIXES):
                continue
            if key not in expected:
                unexpected.append(key)
                continue
            found[key] = f.get_tensor(key)
    missing = sorted(set(expected) - set(found))
    wrong_shape = [f"{k}: file {tuple(t.shape)} vs model {tuple(expected[k].shape)}"
                   for k, t in found.items() if t.shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing decoder tensors: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected)[:10])}")
    if wrong_shape:
        problems.append(f"shape mismatches: {'; '.join(wrong_shape[:10])}")
    if problems:
        raise CheckpointError(f"{weights_path} does not match the decoder config in config.json (another model's "
                              "weights, or another architecture's config?): " + " | ".join(problems)
                              + "; give the config.json and model.safetensors of one speech_tokenizer folder")
    state = {k[len(DECODER_PREFIX):]: t.float() for k, t in found.items()}
    model.decoder.load_state_dict(state, strict=True)
    model.refresh_codebooks()
    return model.eval(), sample_rate_hz


def random_model(cfg: DecoderConfig = SHIPPED, seed: int = 0) -> Qwen3TTSDecoder:
    """The architecture with seeded random weights (float32, CPU). Codebooks are random, so audio depends
    on the codes; scales are chosen to give speech-like levels (not saturated, not silent)."""
    gen = torch.Generator().manual_seed(seed)
    model = Qwen3TTSDecoder(cfg)
    with torch.no_grad():
        for name, param in model.decoder.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "embedding_sum":
                param.copy_(torch.randn(param.shape, generator=gen))
            elif leaf == "cluster_usage":
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            elif leaf in ("alpha", "beta"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif leaf in ("scale", "gamma"):
                param.fill_(0.1)
            elif leaf == "bias":
                param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
            elif param.dim() == 1:  # norm weights
                param.fill_(1.0)
        for module in model.decoder.modules():  # weights scaled by fan-in
            if isinstance(module, torch.nn.ConvTranspose1d):
                fan_in = module.in_channels * module.kernel_size[0] // module.stride[0]
            elif isinstance(module, (torch.nn.Conv1d, torch.nn.Linear)):
                fan_in = math.prod(module.weight.shape[1:])
            else:
                continue
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) / math.sqrt(fan_in))
        # Keep residual branches small and the output layer quiet, so the stack neither explodes nor clips.
        for module in model.decoder.modules():
            if isinstance(module, DenseResidualUnit):
                module.conv2.conv.weight.mul_(0.3)
        model.decoder.decoder[-1].conv.weight.mul_(RANDOM_OUTPUT_GAIN)
    model.refresh_codebooks()
    log.warning("=" * 72)
    log.warning("RANDOM WEIGHTS: the decoder was built with seeded random weights (seed %d).", seed)
    log.warning("Audio is noise-like and only useful for testing and benchmarks. Pass --model PATH")
    log.warning("(a speech_tokenizer/ folder) to decode real speech.")
    log.warning("=" * 72)
    return model.eval()
