"""Shared fixtures: golden data, the tiny model, and a real sidecar server on an ipc:// socket in a temp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loadgen.spawn import SpawnedSidecar, spawn_sidecar

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CODE2WAV_SHARED", ROOT.parent / "shared"))
GOLDEN = SHARED / "golden"
TINY = GOLDEN / "tiny_a"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def golden_cases() -> dict[str, torch.Tensor]:
    if not TINY.is_dir():
        pytest.fail(f"golden vectors not found at {TINY}; set CODE2WAV_SHARED to the shared/ folder")
    return load_file(str(TINY / "cases.safetensors"))


@pytest.fixture(scope="session")
def tiny_model():
    from sidecar.models import load_model

    return load_model(str(TINY), torch.device("cpu"), "float32")


def start_sidecar(tmp_path: Path, *extra: str, model: str = str(TINY)) -> SpawnedSidecar:
    """A real ``python -m sidecar serve`` on the tiny golden model, CPU, ipc:// socket under ``tmp_path``."""
    return spawn_sidecar("--model", model, "--device", "cpu", "--max-streams", "64", *extra, workdir=tmp_path)


@pytest.fixture
def sidecar(tmp_path):
    running = start_sidecar(tmp_path)
    yield running
    running.stop()
