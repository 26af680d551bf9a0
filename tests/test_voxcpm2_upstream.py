"""The ``voxcpm2-upstream`` bench baseline against the REAL upstream module (``voxcpm`` 2.0.3's
``audio_vae_v2.py``, loaded on its own; skipped without the distribution): given our folded weights it decodes what
our decoder decodes (one-shot, sample-rate conditioned, streamed in 4-frame patches), a weight copy that does not
cover it raises, a missing distribution is a skip with the pip command, and the bench writes the rows, the
cross-check and the ratios."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from code2wav.loadgen import voxcpm2_upstream as up
from code2wav.sidecar.models.voxcpm2_audiovae import load_folder
from conftest import ROOT

GOLDEN = Path(__file__).parent / "data" / "golden" / "voxcpm2_tiny_a"
TOL = 1e-5


def _installed() -> bool:
    try:
        importlib.metadata.distribution(up.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _installed(), reason=f"needs voxcpm's AudioVAE file: {up.PIP_HINT}")


@pytest.fixture(scope="module")
def ours():
    module, _ = load_folder(GOLDEN)
    return module


@pytest.fixture(scope="module")
def vae(ours):
    return up.build_upstream(ours, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "cases.safetensors"))


def test_loaded_without_importing_the_voxcpm_package(vae):
    assert type(vae).__module__ == up.PRIVATE_NAME
    assert "voxcpm" not in sys.modules  # its __init__ would pull transformers, gradio, ...
    assert Path(sys.modules[up.PRIVATE_NAME].__file__) == up.module_path()
    assert importlib.metadata.version(up.DISTRIBUTION) == up.VERSION


@torch.no_grad()
def test_upstream_one_shot_equals_our_forward(ours, vae, cases):
    latents = cases["latents"]  # [2, 16, 57]
    theirs = vae.decode(latents)  # [2, 1, 57 * 240]
    mine = ours(latents)
    assert theirs.shape == mine.shape == (2, 1, 57 * 240)
    assert (theirs - mine).abs().max().item() <= TOL
    assert (theirs - cases["full"]).abs().max().item() <= TOL  # the golden upstream made from the original g, v
    conditioned = vae.decode(latents, cases["sr_cond"])  # buckets 0 and 2: the scale/bias embeddings were copied
    assert (conditioned - ours(latents, ours.sr_bucket(cases["sr_cond"], batch=2))).abs().max().item() <= TOL
    assert (conditioned - theirs).abs().max().item() > 1e-2


@torch.no_grad()
def test_upstream_streaming_in_4_frame_patches_equals_our_forward(ours, vae, cases):
    latents = cases["latents"]  # [2, 16, 57]: 14 patches of 4 frames, then 1
    streamed, times_s = up.stream_decode(vae, latents, 4, torch.device("cpu"))
    assert len(times_s) == 15 and all(t > 0 for t in times_s)
    assert (streamed - ours(latents)).abs().max().item() <= TOL
    again, _ = up.stream_decode(vae, latents, 4, torch.device("cpu"))  # a fresh stream: no state left behind
    assert torch.equal(again, streamed)


@torch.no_grad()
def test_cross_check_reports_the_difference(ours, vae, cases):
    from code2wav.sidecar.models import load_model

    model = load_model(str(GOLDEN), torch.device("cpu"))
    check = up.cross_check(vae, model, cases["latents"])
    assert check["oneshot"]["max_abs_diff"] <= TOL and check["stream_t4"]["max_abs_diff"] <= TOL
    assert check["oneshot"]["snr_db"] is None or check["oneshot"]["snr_db"] > 90


def test_weight_copy_that_does_not_cover_upstream_raises(ours):
    fresh = up.upstream_vae(ours.cfg)
    state = ours.checkpoint_state_dict()
    missing = {k: v for k, v in state.items() if k != "decoder.model.1.weight"}
    with pytest.raises(up.UpstreamWeightError, match=r"no source in our model: \['decoder.model.1.weight_g', "
                                                     r"'decoder.model.1.weight_v'\]"):
        up.copy_decoder_weights(fresh, missing)
    with pytest.raises(up.UpstreamWeightError, match="shapes differ: .*decoder.model.0.bias"):
        up.copy_decoder_weights(fresh, {**state, "decoder.model.0.bias": torch.zeros(3)})
    with pytest.raises(up.UpstreamWeightError, match="no place for: \\['decoder.extra.weight'\\]"):
        up.copy_decoder_weights(fresh, {**state, "decoder.extra.weight": torch.zeros(3)})
    up.copy_decoder_weights(fresh, state)  # the full set loads


def test_missing_distribution_is_a_skip_with_the_pip_command(monkeypatch):
    from code2wav.loadgen.bench import build_parser
    from code2wav.sidecar.models import load_model

    # Our own lookup pointed at a name no one installs (the real voxcpm stays installed for the other tests).
    monkeypatch.setattr(up, "DISTRIBUTION", "code2wav-test-no-such-distribution")
    monkeypatch.delitem(sys.modules, up.PRIVATE_NAME, raising=False)
    model = load_model(str(GOLDEN), torch.device("cpu"))
    result = up.run_upstream_step(build_parser().parse_args([]), model, [])
    assert set(result) == {"skipped"}
    assert "pip install --no-deps voxcpm==2.0.3" in result["skipped"]
    with pytest.raises(up.UpstreamUnavailable, match="voxcpm is not installed"):
        up.module_path()


def test_bench_measures_upstream_and_ours_in_the_same_run(tmp_path):
    report_path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "code2wav.sidecar", "bench", "--model", str(GOLDEN), "--device", "cpu",
         "--concurrency", "1", "--frames", "8", "--first-chunk-frames", "4", "--chunk-frames", "4",
         "--baseline-iters", "2", "--baseline-batch", "1,64", "--baseline-frames", "4,25", "--baseline", "none",
         "--json", str(report_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(report_path.read_text())
    rows = {b["name"]: b for b in report["baselines"]}
    assert {(rows[n]["batch"], rows[n]["new_frames"]) for n in
            ("exact-eager-b1", "exact-eager-b64", "exact-eager-b1-t25", "exact-eager-b64-t25")} == \
        {(1, 4), (64, 4), (1, 25), (64, 25)}
    assert (rows["voxcpm2-upstream-stream-b1-t4"]["batch"], rows["voxcpm2-upstream-stream-b1-t4"]["new_frames"]) \
        == (1, 4)
    assert rows["voxcpm2-upstream-stream-b1-t4"]["iters"] == up.MIN_STREAMS * up.STREAM_PATCHES  # all patches timed
    assert rows["voxcpm2-upstream-oneshot-b64-t25"]["new_frames"] == 25
    assert len(report["baselines"]) == len(rows)  # names are unique
    upstream = report["voxcpm2_upstream"]
    assert upstream["voxcpm"] == "2.0.3" and upstream["cross_check"]["oneshot"]["max_abs_diff"] <= TOL
    assert upstream["cross_check"]["stream_t4"]["max_abs_diff"] <= TOL
    assert upstream["stream"]["first_patch_ms_p50"] > 0
    assert set(upstream["ratios"]) == {
        "exact-eager-b1 vs voxcpm2-upstream-stream-b1-t4: p50 latency, upstream/ours",
        "exact-eager-b64-t25 vs voxcpm2-upstream-oneshot-b64-t25: audio-s/s, ours/upstream"}
    assert "ours vs upstream: exact-eager-b1 vs voxcpm2-upstream-stream-b1-t4" in proc.stdout
    assert "x = ratio to voxcpm2-upstream-stream-b1-t4" in proc.stdout  # the sidecar table's reference


def test_ratios_compare_the_graph_row_else_the_eager_row_with_upstream():
    """Ours against upstream: the graph row where there is one, else the eager one (CPU, no GPU)."""
    def row(name, batch, frames, p50, rate):
        return {"name": name, "batch": batch, "new_frames": frames, "latency_ms_p50": p50, "audio_s_per_s": rate}

    ours = [row("exact-eager-b1", 1, 4, 6.0, 1), row("exact-graph-b1", 1, 4, 2.0, 1),
            row("exact-eager-b64-t25", 64, 25, 100, 500.0)]
    upstream = [row("voxcpm2-upstream-stream-b1-t4", 1, 4, 6.0, 1),
                row("voxcpm2-upstream-oneshot-b64-t25", 64, 25, 80, 800.0)]
    assert up.ratios(ours, upstream) == {
        "exact-graph-b1 vs voxcpm2-upstream-stream-b1-t4: p50 latency, upstream/ours": 3.0,
        "exact-eager-b64-t25 vs voxcpm2-upstream-oneshot-b64-t25: audio-s/s, ours/upstream": 0.62}
