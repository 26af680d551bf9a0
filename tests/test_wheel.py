"""The wheel, as a user installs it: built from this checkout (``pip wheel``), installed into a fresh virtual
environment, then used from outside the checkout - ``code2wav.__version__`` and the CLI's version, the LICENSE and
the deploy overlay inside the wheel, the vLLM-Omni plugin entry points, and one chunk decoded by the installed
server for the installed client, compared with the golden audio.

The fresh environment gets the wheel with ``--no-deps``; its dependencies (torch, pyzmq, ...) are the test
environment's, reached through a ``.pth`` line (a path line only: the test environment's own ``.pth`` files, its
editable install of this project among them, are not run), so nothing is downloaded but the build backend.
About 10 s on two CPU cores; ``.ci/run`` runs it with the rest (``python -m pytest -q``).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, TINY

OVERLAY = ROOT / "deploy" / "vllm-omni" / "qwen3_tts_sidecar.yaml"
PACKAGED_OVERLAY = ROOT / "client" / "vllm_omni" / "qwen3_tts_sidecar.yaml"

# Runs in the fresh environment, in a folder outside the checkout: start the installed `code2wav-sidecar serve` on
# the tiny golden model, decode one chunk with the installed client, report what was imported from where.
PROBE = textwrap.dedent("""
    import importlib.metadata as md, json, subprocess, sys, torch
    from pathlib import Path
    from safetensors.torch import load_file
    import code2wav, code2wav.client.vllm_omni as plugin
    from code2wav.client import SidecarClient

    model, bindir, workdir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    eps = {e.name: e for e in md.entry_points(group="vllm_omni.general_plugins")}
    for ep in eps.values():
        ep.load()()                                   # register(): a no-op without vLLM-Omni, never an error
    address = f"ipc://{workdir}/sock/sidecar.sock"
    serve = subprocess.Popen([str(bindir / "code2wav-sidecar"), "serve", "--model", model, "--device", "cpu",
                              "--address", address, "--metrics-port", "0"],
                             stdout=subprocess.PIPE, stderr=open(workdir / "serve.log", "w"), text=True)
    ready = serve.stdout.readline()
    try:
        cases = load_file(f"{model}/cases.safetensors")
        codes, full = cases["codes"][0][:, :5], cases["full"][0, 0]       # [Q, 5], [samples]
        with SidecarClient(address, timeout_s=60) as client:
            audio = client.open_stream("wheel").decode(codes, final=True)  # [5 * U] float32
        max_abs = (audio - full[:audio.numel()]).abs().max().item()
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    print(json.dumps({"version": code2wav.__version__, "code2wav": code2wav.__file__, "ready": ready,
                      "entry_points": {n: e.value for n, e in eps.items()}, "overlay": str(plugin.DEPLOY_CONFIG),
                      "overlay_bytes": plugin.DEPLOY_CONFIG.read_text(), "samples": audio.numel(),
                      "max_abs": max_abs, "serve_exit": serve.returncode}))
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("code2wav_sidecar-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment with the wheel installed (no dependencies: they come from this environment)."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "test_env_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env_dir


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_wheel_carries_the_license_the_overlay_and_every_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    assert "code2wav/__init__.py" in names and "code2wav/_version.py" in names
    assert "code2wav/client/vllm_omni/qwen3_tts_sidecar.yaml" in names and "code2wav/proto/README.md" in names
    for package in ("sidecar", "client", "proto", "loadgen", "cudart"):
        assert f"code2wav/{package}/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "deploy/"))]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Project-URL: vLLM-Omni, https://" in metadata


def test_packaged_overlay_is_the_deploy_overlay():
    assert PACKAGED_OVERLAY.read_bytes() == OVERLAY.read_bytes(), \
        "client/vllm_omni/qwen3_tts_sidecar.yaml is the wheel's copy of deploy/vllm-omni/qwen3_tts_sidecar.yaml"


def test_installed_wheel_reports_its_version_registers_its_plugins_and_decodes_a_chunk(venv, tmp_path):
    python, bindir = venv / "bin" / "python", venv / "bin"
    work = tmp_path / "work"
    (work / "sock").mkdir(parents=True, mode=0o700)
    version = subprocess.run([str(bindir / "code2wav-sidecar"), "--version"], capture_output=True, text=True,
                             cwd=work, env=_clean_env(), timeout=120)
    assert version.returncode == 0, version.stderr
    import code2wav

    assert version.stdout.split()[:2] == ["code2wav-sidecar", code2wav.__version__]
    proc = subprocess.run([str(python), "-c", PROBE, str(TINY), str(bindir), str(work)], capture_output=True,
                          text=True, cwd=work, env=_clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + (work / "serve.log").read_text()[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["version"] == code2wav.__version__ and code2wav.__version__ != "0+unknown"
    assert Path(seen["code2wav"]).is_relative_to(venv)  # the installed package, not this checkout
    assert seen["entry_points"] == {"code2wav_sidecar": "code2wav.client.vllm_omni:register",
                                    "code2wav_sidecar_voxcpm2": "code2wav.client.vllm_omni_voxcpm2:register"}
    assert Path(seen["overlay"]).is_relative_to(venv) and seen["overlay_bytes"] == OVERLAY.read_text()
    assert seen["ready"].startswith("code2wav-sidecar ready:") and seen["serve_exit"] == 0
    assert seen["samples"] == 5 * 48  # the tiny model: 48 samples per frame
    assert seen["max_abs"] <= 1e-5  # the golden audio (exact streaming), as tests/test_first_hour.py checks it
