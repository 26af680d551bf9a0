"""Weights that cannot be loaded are named in one line with the fix (issue 43, item 2): a truncated safetensors
file, a Git LFS pointer (both families' weight files), another architecture's checkpoint, a checkpoint root. The
files are built here from the tiny golden models; good files still load to the same numbers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from code2wav.sidecar.models import CheckpointError, FamilyError, detect_family, load_model
from code2wav.sidecar.models.registry import check_model_spec
from code2wav.sidecar.models.weights_file import check_weights_file
from conftest import TINY, VOXCPM2_TINY

LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 123456\n"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_whole_safetensors_file_passes_and_loads_as_before(tmp_path, golden_cases):
    check_weights_file(TINY / "model.safetensors")
    model = load_model(str(_copy(TINY, tmp_path / "ok")), torch.device("cpu"))
    with torch.no_grad():
        wav = model.forward(golden_cases["codes"])  # [B, 1, T * U]
    assert torch.allclose(wav, golden_cases["full"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("keep_fraction, words", [(0.5, "truncated ("), (0.0001, "truncated inside its header"),
                                                 (0.0, "is empty: download it again")])
def test_a_truncated_safetensors_file_is_named_with_the_fix(tmp_path, keep_fraction, words):
    folder = _copy(TINY, tmp_path / "cut")
    data = (TINY / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: max(0, int(len(data) * keep_fraction))] if keep_fraction else b"")
    with pytest.raises(CheckpointError) as info:
        load_model(str(folder), torch.device("cpu"))
    message = str(info.value)
    assert words in message and "model.safetensors" in message and "\n" not in message
    if keep_fraction == 0.5:
        assert f"{len(data) // 2} bytes of {len(data)}" in message and "download it again" in message


@pytest.mark.parametrize("model, weights", [(TINY, "model.safetensors"), (VOXCPM2_TINY, "audiovae.pth")])
def test_a_git_lfs_pointer_is_named_with_git_lfs_pull(tmp_path, model, weights):
    folder = _copy(model, tmp_path / "lfs")
    (folder / weights).write_bytes(LFS_POINTER)
    with pytest.raises(CheckpointError, match=r"is a Git LFS pointer \(\d+ bytes\), not the weights: fetch them with "
                                              r"`git lfs install && git lfs pull`"):
        load_model(str(folder), torch.device("cpu"))


def test_another_architectures_weights_are_named_with_the_fix(tmp_path):
    folder = _copy(TINY, tmp_path / "other")
    save_file({"decoder.other.weight": torch.zeros(3, 3)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_model(str(folder), torch.device("cpu"))
    message = str(info.value)
    assert "does not match the decoder config in config.json (another model's weights" in message
    assert "unexpected tensors: decoder.other.weight" in message and "missing decoder tensors:" in message
    assert message.endswith("give the config.json and model.safetensors of one speech_tokenizer folder")
    not_safetensors = _copy(TINY, tmp_path / "pickle")
    (not_safetensors / "model.safetensors").write_bytes(b"\x80\x04\x95" + b"\x00" * 64)  # a torch pickle's start
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        load_model(str(not_safetensors), torch.device("cpu"))


def test_a_checkpoint_root_suggests_its_speech_tokenizer_folder(tmp_path):
    root = tmp_path / "Qwen3-TTS"
    _copy(TINY, root / "speech_tokenizer")
    without_config = f"{root} is a checkpoint root; give its decoder folder: --model {root / 'speech_tokenizer'}"
    with pytest.raises(FamilyError) as info:
        detect_family(root)
    assert str(info.value) == without_config
    (root / "config.json").write_text(json.dumps({"architectures": ["Qwen3TTSForConditionalGeneration"]}))
    assert check_model_spec(str(root)) == (f"--model {root} is a checkpoint root (its config.json is the TTS "
                                           f"model's); give its decoder folder: --model {root / 'speech_tokenizer'}")
    assert check_model_spec(str(root / "speech_tokenizer")) is None
    assert "no such folder" in check_model_spec(str(tmp_path / "missing"))
