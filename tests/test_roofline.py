"""``code2wav-sidecar profile --by layer`` (``loadgen/roofline.py``) on the CPU: the layer walk covers every weight of
both families exactly once with disjoint layers; the per-layer FLOPs add up to an independent count of the whole
step; the shares and the text table agree with the JSON the command writes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from code2wav.loadgen.step_stage import staged_step
from code2wav.loadgen.roofline import format_layers, layers, profile_layers
from code2wav.sidecar.models import load_model
from conftest import ROOT, TINY, VOXCPM2_TINY

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("model_path", [TINY, VOXCPM2_TINY], ids=["qwen3-tts", "voxcpm2"])
def test_the_layers_cover_every_weight_once_and_do_not_nest(model_path):
    model = load_model(str(model_path), torch.device("cpu"), "float32")
    named = layers(model.module)
    names = [n for n, _ in named]
    assert len(set(names)) == len(names) > 10
    for a in names:  # disjoint: no layer inside another
        assert not any(b != a and b.startswith(a + ".") for b in names), a
    owned = [id(p) for _, m in named for p in m.parameters()]
    assert len(owned) == len(set(owned))  # each weight in one layer
    assert set(owned) == {id(p) for p in model.module.parameters()}  # and every weight in some layer


def _step_flops(model) -> float:
    """An independent count: ``FlopCounterMode`` over one whole 2 x 4 step (after an uncounted one)."""
    with torch.inference_mode():
        step = staged_step(model, 2, 4)
        step()
        with FlopCounterMode(display=False) as counter:
            step()
    return counter.get_total_flops()


@pytest.mark.parametrize("model_path", [TINY, VOXCPM2_TINY], ids=["qwen3-tts", "voxcpm2"])
def test_the_layer_flops_add_up_to_the_step(model_path):
    model = load_model(str(model_path), torch.device("cpu"), "float32")
    p = profile_layers(model, batch=2, num_frames=4, steps=1, warmup=1)
    assert sum(r.gflop for r in p.layers) * 1e9 == pytest.approx(_step_flops(model), rel=1e-9)
    assert p.unit == "operator" and p.peak_tflops is None and p.total_us > 0
    # on the CPU every operator is a layer's, or a group's own work (a transformer's rotary set-up): no time outside
    assert math.isclose(sum(r.share for r in p.layers), 1.0, rel_tol=1e-6) and p.unattributed_us < 1e-6 * p.total_us
    assert any(r.kind.endswith(", own work") for r in p.layers)
    convs = [r for r in p.layers if r.kind in ("CausalConv", "DenseResidualUnit", "ResidualUnit")]
    assert convs and all(r.gflop > 0 and r.mbytes > 0 and r.kernels for r in convs)
    text = format_layers(p).splitlines()
    assert len(text) >= 2 + len(p.layers) + 1 and all(r.name in line for r, line in zip(p.layers, text[2:]))


def test_the_profile_command_writes_the_layer_table_it_prints(tmp_path):
    out = tmp_path / "layers.json"
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", "profile", "--by", "layer", "--model", str(TINY),
                           "--device", "cpu", "--batch", "1", "--frames", "2", "--steps", "1", "--warmup", "1",
                           "--conv-forms", "cudnn_cl", "--json", str(out)], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["by"] == "layer" and report["settings"]["conv_forms"] == "cudnn_cl"
    lines = proc.stdout.splitlines()
    rows = report["layers"]
    for line, row in zip(lines[2:2 + len(rows)], rows):
        assert line.split()[0] == f"{row['kernel_us']:.1f}" and f"{row['name']} ({row['kind']})" in line


def test_a_block_that_runs_its_layers_work_itself_gets_an_own_work_row(monkeypatch):
    """On the fused path (forced here on the CPU, as ``test_fused_paths_cpu.py`` does) a VoxCPM2 residual unit runs
    its 1x1 conv itself (``residual_matmul_``) without calling that layer: the unit's own row carries the GEMM's
    FLOPs, and the rows still add up to the step."""
    from code2wav.sidecar.models.streaming import CausalConv, StreamActivation

    monkeypatch.setattr(StreamActivation, "runs_fused", lambda self, x: not torch.compiler.is_compiling())
    monkeypatch.setattr(CausalConv, "runs_depthwise_kernel",
                        lambda self, x: self.depthwise and self.kernels_on and not torch.compiler.is_compiling())
    model = load_model(str(VOXCPM2_TINY), torch.device("cpu"), "float32")
    for sub in model.module.modules():
        if hasattr(sub, "kernels_on"):
            sub.kernels_on = True
    p = profile_layers(model, batch=2, num_frames=4, steps=1, warmup=1)
    assert sum(r.gflop for r in p.layers) * 1e9 == pytest.approx(_step_flops(model), rel=1e-9)
    own = [r for r in p.layers if r.kind.endswith(", own work") and r.gflop > 0]
    assert own and any("ResidualUnit" in r.kind for r in own), [(r.name, r.kind, r.gflop) for r in p.layers]
    assert any(r.endswith(".block.2") or ".conv2" in r for r in p.not_called), p.not_called  # the 1x1 conv's layer


def test_an_unknown_conv_form_is_a_usage_error_before_loading():
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", "profile", "--model", "/no/such/folder",
                           "--device", "cpu", "--conv-forms", "cudnn_cl,gem"], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("--conv-forms: unknown form gem (known: cudnn, cudnn_cl, polyphase, gemm, gemm_cl, gemm_tma, im2col, "
            "unit_tma" in proc.stderr)
