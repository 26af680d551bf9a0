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


@pytest.mark.parametrize("model_path", [TINY, VOXCPM2_TINY], ids=["qwen3-tts", "voxcpm2"])
def test_the_layer_flops_add_up_to_the_step(model_path):
    model = load_model(str(model_path), torch.device("cpu"), "float32")
    p = profile_layers(model, batch=2, num_frames=4, steps=1, warmup=1)
    with torch.inference_mode():
        step = staged_step(model, 2, 4)
        step()
        with FlopCounterMode(display=False) as counter:
            step()
    assert sum(r.gflop for r in p.layers) * 1e9 == pytest.approx(counter.get_total_flops(), rel=1e-9)
    assert p.unit == "operator" and p.peak_tflops is None and p.total_us > 0
    # on the CPU every operator is a layer's, or a group's own (a transformer's rotary set-up): outside the layers
    assert math.isclose(sum(r.share for r in p.layers) + p.unattributed_us / p.total_us, 1.0, rel_tol=1e-6)
    assert p.unattributed_us < 0.1 * p.total_us
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
