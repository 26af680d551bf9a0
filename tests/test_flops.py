"""The bench's compute ceiling (CPU): FLOPs per audio-second counted on the loaded model (issue 21: 62 GFLOP for
the Qwen3-TTS 12 Hz decoder; issue 23: about 18 for VoxCPM2's AudioVAE decoder), the peak per GPU and dtype, and
the fraction printed next to every row."""

from __future__ import annotations

import pytest

from code2wav.loadgen.flops import compute_summary, flops_per_audio_s, peak_flops
from code2wav.loadgen.report import BenchReport, ceiling_fraction, load
from code2wav.sidecar.models import load_model


@pytest.mark.parametrize("spec, gflop", [("default", 62.0), ("voxcpm2-default", 18.0)])
def test_shipped_architectures_count_as_the_issues_state(spec, gflop):
    model = load_model(spec, "cpu", "float32")
    assert flops_per_audio_s(model) / 1e9 == pytest.approx(gflop, rel=0.06)


def test_peak_and_ceiling():
    assert peak_flops("NVIDIA H200", "bfloat16") == (790e12, "assumed for H200 bfloat16 (loadgen/flops.py)")
    assert peak_flops("NVIDIA H200", "float32")[0] == 67e12
    assert peak_flops("NVIDIA H200", "float32", peak_tflops=100.0) == (100e12, "--peak-tflops")
    unknown, why = peak_flops(None, "float32")
    assert unknown is None and "--peak-tflops" in why
    model = load_model("default", "cpu", "float32")
    compute = compute_summary(model, "NVIDIA H200", "bfloat16")
    assert compute["ceiling_audio_s_per_s"] == pytest.approx(790e12 / 62e9, rel=0.01)  # ~12,700 (issue 21)
    assert ceiling_fraction(1270.0, compute) == pytest.approx(0.1, rel=0.01)
    assert ceiling_fraction(1270.0, compute_summary(model, None, "float32")) is None


def test_the_report_keeps_the_compute_entry(tmp_path):
    compute = {"flops_per_audio_s": 62e9, "peak_flops": 790e12, "peak_source": "x", "ceiling_audio_s_per_s": 12741.9}
    report = BenchReport({"device": "cpu", "gpu": None}, {"arrival": "closed"}, compute=compute)
    path = tmp_path / "r.json"
    report.write(str(path))
    assert load(str(path)).compute == compute
