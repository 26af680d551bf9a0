"""The client treats both input kinds alike: ``ModelInfo`` describes either family (input kind, channels, dtypes,
frame rate), the README's two client examples run as written against a server of their family (a doc test: the
blocks are read from README.md), refusals use the family's own words, and a missing ``ipc://`` socket or an
address of the wrong form is refused at once, in one line. Real servers (tiny golden models, CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from code2wav.proto.address import address_problem
from conftest import ROOT, TINY, VOXCPM2_TINY, start_sidecar

TOL = 1e-5  # exact streaming against one decode of every frame, as tests/test_first_hour.py checks it


@pytest.fixture(scope="module")
def codes_sidecar(tmp_path_factory):
    running = start_sidecar(tmp_path_factory.mktemp("codes"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def latents_sidecar(tmp_path_factory):
    running = start_sidecar(tmp_path_factory.mktemp("latents"), model=str(VOXCPM2_TINY))
    yield running
    running.stop()


# ------------------------------------------------------------------ ModelInfo for either family

def test_model_info_describes_a_codes_model(codes_sidecar):
    with SidecarClient(codes_sidecar.address, timeout_s=30) as client:
        info = client.models[0]
    assert (info.family, info.input_kind, info.channels, info.num_quantizers, info.codebook_size) == (
        "qwen3_tts", "codes", 4, 4, 64)  # tests/data/golden/tiny_a/config.json
    assert info.input_dtypes == ("int16", "int32", "int64") and info.valid_range == (0, 64)
    assert (info.samples_per_frame, info.sample_rate, info.frame_rate_hz) == (48, 24000, 500.0)
    assert info.inputs_text == "codes [4, n] (int16/int32/int64, values in [0, 64))"


def test_model_info_describes_a_latents_model(latents_sidecar):
    with SidecarClient(latents_sidecar.address, timeout_s=30) as client:
        info = client.models[0]
        wire = client.server_info.to_wire()["models"][0]
    assert (info.family, info.input_kind, info.channels, info.num_quantizers, info.codebook_size) == (
        "voxcpm2_audiovae", "latents", 16, 16, None)  # tests/data/golden/voxcpm2_tiny_a/config.json
    assert info.input_dtypes == ("float32", "bfloat16") and info.valid_range is None
    assert (info.samples_per_frame, info.sample_rate, info.frame_rate_hz) == (240, 48000, 200.0)
    assert info.inputs_text == "latents [16, n] (float32/bfloat16, finite)"
    assert wire["codebook_size"] == 0  # on the wire it stays 0: older clients read what they always read


# ------------------------------------------------------------------ the README's examples, as written

def _readme_examples() -> dict[str, str]:
    """The README's Python blocks that use the client, by input kind (the block that makes latents is the
    VoxCPM2 one)."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    found = {("latents" if "latents = " in body else "codes"): body for body in blocks if "SidecarClient" in body}
    assert sorted(found) == ["codes", "latents"] and len(found) == len(blocks)
    return found


# Runs after a README block, in the same process: decodes the block's inputs again in one chunk and reports.
CHECK = """
import json as _json
_inputs = globals().get("codes", globals().get("latents"))
with SidecarClient() as _again:
    _whole = _again.open_stream("whole").decode(_inputs, final=True)
print(_json.dumps({"kind": info.input_kind, "codebook_size": info.codebook_size, "frames": _inputs.shape[1],
                   "samples": audio.numel(), "samples_per_frame": info.samples_per_frame,
                   "max_abs": (audio - _whole).abs().max().item()}))
"""


@pytest.mark.parametrize("kind,model", [("codes", TINY), ("latents", VOXCPM2_TINY)])
def test_readme_client_example_runs_for_its_family(tmp_path, kind, model):
    """Each README block, unchanged, against ``serve`` at its default address (the same environment); its audio
    equals one decode of all its frames."""
    (tmp_path / "xdg").mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    env.pop("CODE2WAV_SIDECAR_ADDRESS", None)
    with open(tmp_path / "serve.log", "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "code2wav.sidecar", "serve", "--model", str(model),
                                  "--device", "cpu", "--metrics-port", "0"],
                                 stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    try:
        assert serve.stdout.readline().startswith("code2wav-sidecar ready:"), (tmp_path / "serve.log").read_text()
        example = _readme_examples()[kind] + CHECK
        proc = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)
    finally:
        serve.terminate()
        assert serve.wait(timeout=60) == 0
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["kind"] == kind and (seen["codebook_size"] is None) == (kind == "latents")
    assert seen["samples"] == seen["frames"] * seen["samples_per_frame"]
    assert seen["max_abs"] <= TOL


# ------------------------------------------------------------------ refusals in the family's words

def test_codes_model_refusals_say_codes(codes_sidecar):
    with SidecarClient(codes_sidecar.address, timeout_s=30) as client:
        stream = client.open_stream("c")
        with pytest.raises(cerr.InvalidArgument, match=r"codes must be an integer tensor, got torch.float32 \(this "
                                                        r"model decodes integer codes \[Q, n\]; float latents"):
            stream.decode(torch.zeros(4, 3))
        with pytest.raises(cerr.InvalidArgument,
                           match=r"codes have 3 quantizers; stream 'c' needs 4 \(codes \[4, n\]\)"):
            stream.decode(torch.zeros(3, 2, dtype=torch.long))
        assert stream.decode(torch.zeros(4, 2, dtype=torch.long)).numel() == 2 * 48  # the stream is still fine


def test_latents_model_refusals_say_latents(latents_sidecar):
    with SidecarClient(latents_sidecar.address, timeout_s=30) as client:
        stream = client.open_stream("l")
        with pytest.raises(cerr.InvalidArgument, match=r"latents must be a floating-point tensor, got torch.int64 "
                                                        r"\(this model decodes float latents \[D, n\]"):
            stream.decode(torch.zeros(16, 4, dtype=torch.long))
        with pytest.raises(cerr.InvalidArgument, match=r"latents have 3 latent channels; stream 'l' needs 16 "
                                                        r"\(latents \[16, n\]\)") as info:
            stream.decode(torch.zeros(3, 4))
        assert "codes" not in str(info.value) and "quantizer" not in str(info.value)
        assert stream.decode(torch.zeros(16, 4)).numel() == 4 * 240


# ------------------------------------------------------------------ addresses: refused at once, in one line

def test_missing_ipc_socket_fails_fast_naming_the_path(tmp_path):
    path = tmp_path / "nobody" / "sidecar.sock"
    t0 = time.monotonic()
    with pytest.raises(cerr.SidecarNotRunning) as info:
        SidecarClient(f"ipc://{path}")  # the default connect_timeout_s (5 s) is not waited
    assert time.monotonic() - t0 < 0.5
    message = info.value.message
    assert "\n" not in message and message.startswith(f"no code2wav sidecar is listening at ipc://{path}: ")
    assert f"the socket file {path} does not exist" in message and "within" not in message


@pytest.mark.parametrize("address,expected", [
    ("/run/code2wav/sidecar.sock", "has no scheme: use ipc:///path/to/sidecar.sock or tcp://host:port"),
    ("localhost:5555", "has no scheme: use ipc:///path/to/sidecar.sock or tcp://host:port"),
    ("http://127.0.0.1:5555", "the sidecar listens on ipc:// or tcp:// only; use ipc:///path"),
    ("tcp://127.0.0.1", "needs a host and a port 1-65535"),
    ("tcp://:5555", "needs a host and a port 1-65535"),
    ("tcp://host:99999", "needs a host and a port 1-65535"),
    ("ipc://", "names no socket file"),
])
def test_an_address_of_the_wrong_form_is_explained(address, expected):
    t0 = time.monotonic()
    with pytest.raises(cerr.InvalidArgument) as info:
        SidecarClient(address)
    assert time.monotonic() - t0 < 0.5 and expected in str(info.value) and repr(address) in str(info.value)


def test_address_forms_the_sidecar_speaks_pass():
    for address in ("ipc:///run/code2wav/sidecar.sock", "ipc://relative.sock", "tcp://127.0.0.1:5555",
                    "tcp://[::1]:5555", "tcp://*:5555", "tcp://gpu-node-3:5555"):
        assert address_problem(address) is None, address
