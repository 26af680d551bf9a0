"""``code2wav-sidecar fidelity``, short CPU version: the tiny golden decoder, one stream of 40 frames without and
with 5 reference frames, through vLLM-Omni's own streaming path (the real package; skipped without it), a real
spawned sidecar in exact and window mode, each compared with one forward over all frames."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from code2wav.loadgen.fidelity import build_parser, compare, run

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "golden" / "tiny_a"


def test_compare_numbers():
    want = torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0, 1.0])
    got = want + torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, -0.25])
    r = compare(got, want, samples_per_frame=2, window_frames=1)
    assert r["max_abs"] == pytest.approx(0.5)
    assert r["mean_abs"] == pytest.approx(0.75 / 6)
    assert r["snr_db"] == pytest.approx(10 * math.log10(12.0 / (0.25 + 0.0625)))
    assert r["max_abs_in_window"] == 0.0 and r["max_abs_after_window"] == pytest.approx(0.5)
    assert r["mean_abs_after_window"] == pytest.approx(0.75 / 4)
    assert compare(want, want, 2, 1)["snr_db"] == math.inf
    with pytest.raises(ValueError, match="audio lengths differ"):
        compare(got[:4], want, 2, 1)


def test_fidelity_short_cpu(tmp_path):
    pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash .ci/install-vllm)")
    out = tmp_path / "fidelity.json"
    args = build_parser().parse_args(["--model", str(TINY), "--device", "cpu", "--frames", "40", "--context-frames",
                                      "5", "--window-left-context", "6", "--json", str(out)])
    report = run(args)
    assert json.loads(out.read_text())["results"] == report["results"]
    window = report["sliding_window_frames"]
    assert window == 6
    rows = {(r["path"], r["context_frames"]): r for r in report["results"]}
    assert set(rows) == {(p, c) for p in ("stock", "exact", "window") for c in (0, 5)}
    for ctx in (0, 5):
        exact = rows[("exact", ctx)]
        assert exact["max_abs"] < 1e-4 and exact["snr_db"] > 60, exact  # the sidecar's exact mode: no drift
        win = rows[("window", ctx)]
        assert win["max_abs_in_window"] < 1e-4, win  # stateless window decode is exact while it sees every frame
        assert win["max_abs_after_window"] > 1e-3, win
    stock = rows[("stock", 0)]
    assert stock["max_abs_in_window"] < 1e-4, stock  # vLLM-Omni's streaming: exact inside the sliding window ...
    assert stock["max_abs_after_window"] > 1e-3 and stock["snr_db"] < rows[("exact", 0)]["snr_db"], stock  # ... then drifts
    assert report["vllm_shim"] is False  # this environment has the real vLLM
