"""Shared fixtures: golden data, the tiny model, and a real sidecar server on an ipc:// socket in a temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from code2wav.loadgen.spawn import SpawnedSidecar, spawn_sidecar

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # everything the tests read; nothing outside the checkout (tests/data/README.md)
GOLDEN = DATA / "golden"
TINY = GOLDEN / "tiny_a"
VOXCPM2_TINY = GOLDEN / "voxcpm2_tiny_a"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_device_memory(request):
    """After a CUDA test: its graphs, pools and tensors go back to the device. Each test builds its own models and
    graph managers; left to the allocator's cache (and to reference cycles the next collection frees), the
    memory of earlier tests added up, and on an 80 GB H100 a later test's captures ran out of memory (the kernel
    tests, then every default bucket of tests/test_cuda_graphs.py)."""
    yield
    if "cuda" in request.keywords and torch.cuda.is_available():
        import gc  # noqa: PLC0415

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def no_tf32():
    """TF32 off for the test (float32 tolerances against the goldens need it), restored after."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="session")
def golden_cases() -> dict[str, torch.Tensor]:
    return load_file(str(TINY / "cases.safetensors"))


@pytest.fixture(scope="session")
def tiny_model():
    from code2wav.sidecar.models import load_model

    return load_model(str(TINY), torch.device("cpu"), "float32")


def start_sidecar(tmp_path: Path, *extra: str, model: str = str(TINY)) -> SpawnedSidecar:
    """A real ``python -m code2wav.sidecar serve`` on the tiny golden model, CPU, ipc:// socket under ``tmp_path``."""
    # on a GPU, the first start on a bare machine compiles and times the conv forms (about 60-100 s measured on an
    # H100 for the default model; later starts read the kernel-choice and Triton caches)
    timeout_s = 300.0 if any(arg.startswith("cuda") for arg in extra) else 120.0
    return spawn_sidecar("--model", model, "--device", "cpu", "--max-streams", "64", *extra, workdir=tmp_path,
                         timeout_s=timeout_s)


@pytest.fixture
def sidecar(tmp_path):
    running = start_sidecar(tmp_path)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def gpu_sidecar(tmp_path_factory):
    """One sidecar of the tiny golden model on the GPU for a test module (``-m cuda`` tests)."""
    running = start_sidecar(tmp_path_factory.mktemp("gpu"), "--device", "cuda")
    yield running
    running.stop()


def counter_total(running: SpawnedSidecar, name: str) -> float:
    """The sidecar's counter ``code2wav_sidecar_<name>_total``, scraped now (0 before its first increment)."""
    from code2wav.loadgen.server_metrics import metric_value

    return metric_value(running.scrape(), f"code2wav_sidecar_{name}_total")


def interpreted_json(code: str):
    """Run ``code`` in a subprocess under Triton's interpreter (``TRITON_INTERPRET`` must be set before Triton is
    imported, so not in this process) and return the JSON on its last line of output (a kernel test's results)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
