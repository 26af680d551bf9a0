"""Loading VoxCPM2 AudioVAE folders: both file kinds, both pickle layouts, weight-norm variants, strict key checks,
and clear errors for folders of another family or none. Folders are built in tmp_path from the golden's file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from code2wav.sidecar.models.voxcpm2_audiovae import (CheckpointError, is_family_folder, load_folder, random_model,
                                                      read_weights)
from code2wav.sidecar.models.voxcpm2_audiovae.config import AudioVAEConfig

GOLDEN = Path(__file__).parent / "data" / "golden" / "voxcpm2_tiny_a"
QWEN3_GOLDEN = Path(__file__).parent / "data" / "golden" / "tiny_a"
TOL = 1e-5


@pytest.fixture(scope="module")
def golden_tensors() -> dict[str, torch.Tensor]:
    tensors, path = read_weights(GOLDEN)
    assert path.name == "audiovae.pth"
    return tensors


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "cases.safetensors"))


def make_folder(root: Path, tensors: dict[str, torch.Tensor] | None, kind: str = "pth-wrapped") -> Path:
    """A model folder with the golden config.json and ``tensors`` saved as ``kind``."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(GOLDEN / "config.json", root / "config.json")
    if tensors is None:
        return root
    if kind == "pth-wrapped":
        torch.save({"state_dict": tensors}, root / "audiovae.pth")
    elif kind == "pth-bare":
        torch.save(tensors, root / "audiovae.pth")
    elif kind == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "audiovae.safetensors"))
    else:
        raise AssertionError(kind)
    return root


def decode_error(model, cases) -> float:
    with torch.no_grad():
        return (model(cases["latents"]) - cases["full"]).abs().max().item()


def test_golden_file_layout(golden_tensors):
    assert sum(k.startswith("decoder.") for k in golden_tensors) == 6 + 28 * 4 + 4 + 2 * 4 + 1  # 131 for n = 4
    assert any(k.startswith("encoder.") for k in golden_tensors)
    assert golden_tensors["decoder.sr_bin_boundaries"].dtype == torch.int32


@pytest.mark.parametrize("kind", ["pth-wrapped", "pth-bare", "safetensors"])
def test_file_kinds_and_layouts(tmp_path, golden_tensors, cases, kind):
    folder = make_folder(tmp_path / kind, golden_tensors, kind)
    assert is_family_folder(folder)
    model, sample_rate_hz = load_folder(folder)
    assert sample_rate_hz == 48000
    assert decode_error(model, cases) <= TOL


def test_safetensors_preferred_over_pth(tmp_path, golden_tensors, cases):
    folder = make_folder(tmp_path / "both", golden_tensors, "safetensors")
    (folder / "audiovae.pth").write_bytes(b"not a torch file: must not be read")
    model, _ = load_folder(folder)
    assert decode_error(model, cases) <= TOL


def test_decoder_only_file_and_folded_variants(tmp_path, golden_tensors, cases):
    decoder_only = {k: v for k, v in golden_tensors.items() if k.startswith("decoder.")}
    model, _ = load_folder(make_folder(tmp_path / "dec", decoder_only))
    assert decode_error(model, cases) <= TOL
    # Newer parametrization names (original0 = g, original1 = v) and already folded weights.
    renamed, folded = {}, {}
    for k, v in decoder_only.items():
        if k.endswith(".weight_g"):
            renamed[k[:-len("weight_g")] + "parametrizations.weight.original0"] = v
            folded[k[:-len("weight_g")] + "weight"] = torch._weight_norm(decoder_only[k[:-1] + "v"], v, 0)
        elif k.endswith(".weight_v"):
            renamed[k[:-len("weight_v")] + "parametrizations.weight.original1"] = v
        else:
            renamed[k] = folded[k] = v
    for name, tensors in (("renamed", renamed), ("folded", folded)):
        model, _ = load_folder(make_folder(tmp_path / name, tensors))
        assert decode_error(model, cases) <= TOL, name


def test_missing_unexpected_and_misshaped_keys(tmp_path, golden_tensors):
    missing = dict(golden_tensors)
    del missing["decoder.model.3.block.2.block.1.weight_v"]
    del missing["decoder.sr_cond_model.3.bias_embed.weight"]
    with pytest.raises(CheckpointError, match=r"audiovae.pth: decoder.model.3.block.2.block.1.weight_g has no "
                                              r"matching decoder.model.3.block.2.block.1.weight_v"):
        load_folder(make_folder(tmp_path / "missing", missing))
    no_embed = dict(golden_tensors)
    del no_embed["decoder.sr_cond_model.3.bias_embed.weight"]
    with pytest.raises(CheckpointError, match=r"missing 1 decoder tensors: decoder.sr_cond_model.3.bias_embed.weight"):
        load_folder(make_folder(tmp_path / "no_embed", no_embed))
    extra = dict(golden_tensors, **{"decoder.model.99.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensors: decoder.model.99.weight"):
        load_folder(make_folder(tmp_path / "extra", extra))
    shaped = dict(golden_tensors)
    shaped["decoder.model.1.bias"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"shape mismatches: decoder.model.1.bias: file \(3,\)"):
        load_folder(make_folder(tmp_path / "shape", shaped))


def test_config_and_file_must_agree(tmp_path, golden_tensors):
    folder = make_folder(tmp_path / "cfg", golden_tensors)
    raw = json.loads((folder / "config.json").read_text())
    raw["audio_vae_config"]["decoder_dim"] = 128
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="does not match the audio_vae_config"):
        load_folder(folder)
    bounds = dict(golden_tensors)
    bounds["decoder.sr_bin_boundaries"] = torch.tensor([19968, 29952, 39936], dtype=torch.int32)
    with pytest.raises(CheckpointError, match="sr_bin_boundaries"):
        load_folder(make_folder(tmp_path / "bounds", bounds))


def test_unknown_and_unsupported_config_keys(tmp_path, golden_tensors):
    folder = make_folder(tmp_path / "typo", golden_tensors)
    raw = json.loads((folder / "config.json").read_text())
    raw["audio_vae_config"]["decoder_rate"] = [2, 2]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"decoder_rate.*|known keys: .*decoder_rates"):
        load_folder(folder)
    raw["audio_vae_config"].pop("decoder_rate")
    raw["audio_vae_config"]["use_noise_block"] = True
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="use_noise_block"):
        load_folder(folder)


def test_pickle_with_objects_is_refused(tmp_path):
    folder = make_folder(tmp_path / "evil", None)
    torch.save({"state_dict": {"decoder.x": AudioVAEConfig()}}, folder / "audiovae.pth")
    with pytest.raises(CheckpointError, match="tensors-only"):
        load_folder(folder)


def test_folders_of_other_kinds(tmp_path):
    assert not is_family_folder(QWEN3_GOLDEN)  # a Qwen3-TTS speech_tokenizer folder
    with pytest.raises(CheckpointError, match="audiovae.safetensors nor audiovae.pth"):
        load_folder(QWEN3_GOLDEN)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not is_family_folder(empty)
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_folder(empty)
    with pytest.raises(CheckpointError, match="not a folder"):
        load_folder(tmp_path / "nowhere")
    config_only = make_folder(tmp_path / "config_only", None)
    assert is_family_folder(config_only)  # audio_vae_config names the family; the weights are what is missing
    with pytest.raises(CheckpointError, match="neither audiovae.safetensors nor audiovae.pth"):
        load_folder(config_only)


def test_random_model_is_seeded_and_speech_level():
    cfg = AudioVAEConfig(latent_dim=16, decoder_dim=64, decoder_rates=(6, 5, 4, 2))
    a, b = random_model(cfg, seed=5), random_model(cfg, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    latents = torch.randn(1, 16, 20, generator=torch.Generator().manual_seed(0))  # std 1
    with torch.no_grad():
        audio = a(latents)
    rms = audio.pow(2).mean().sqrt().item()
    assert 0.02 < rms < 0.7 and (audio.abs() > 0.999).float().mean().item() < 0.01
