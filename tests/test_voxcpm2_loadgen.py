"""Synthetic bench inputs by model contract: codes for a codes model, std-1 float latents for VoxCPM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from code2wav.loadgen.inputs import InputContract, synthetic_batch, synthetic_inputs
from code2wav.proto import ModelInfo
from code2wav.sidecar.models.voxcpm2_audiovae import load_folder

GOLDEN = Path(__file__).parent / "data" / "golden" / "voxcpm2_tiny_a"


def test_codes_contract_from_model_info():
    info = ModelInfo("qwen3-tts-12hz", 16, 2048, 1920, 24000, ("exact", "window"), "float32", "cpu")
    contract = InputContract.of(info)
    assert contract == InputContract("codes", 16, 2048)
    codes = synthetic_inputs(contract, 300, seed=1)
    assert codes.dtype == torch.int64 and codes.shape == (16, 300)
    assert int(codes.min()) >= 0 and int(codes.max()) < 2048
    assert torch.equal(codes, synthetic_inputs(contract, 300, seed=1))


def test_latents_contract_decodes():
    model, _ = load_folder(GOLDEN)
    contract = InputContract.of(model)
    assert contract == InputContract("latents", 16)
    latents = synthetic_batch(contract, 3, 400, seed=5)  # [3, 16, 400]
    assert latents.dtype == torch.float32 and latents.shape == (3, 16, 400)
    assert abs(latents.std().item() - 1.0) < 0.02 and abs(latents.mean().item()) < 0.02
    assert not torch.equal(latents[0], latents[1])
    with torch.no_grad():
        audio = model(latents[:, :, :20])  # [3, 1, 20 * 240]
    assert torch.isfinite(audio).all() and 0.05 < audio.pow(2).mean().sqrt().item() < 0.9


def test_contract_of_a_loaded_model_and_a_latents_welcome():
    from code2wav.sidecar.models import load_model

    assert InputContract.of(load_model(str(GOLDEN), torch.device("cpu"))) == InputContract("latents", 16)
    info = ModelInfo("voxcpm2-audiovae", 16, 0, 240, 48000, ("exact", "window"), "float32", "cpu",
                     input_kind="latents", input_dtypes=("float32",), input_channels=16)
    assert InputContract.of(info) == InputContract("latents", 16)


def test_contract_errors():
    with pytest.raises(ValueError, match="codebook_size"):
        InputContract("codes", 16)
    with pytest.raises(ValueError, match="'codes' or 'latents'"):
        InputContract("audio", 16)  # type: ignore[arg-type]
