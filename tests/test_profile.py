"""``code2wav-sidecar profile`` (``loadgen/profile.py``) on the CPU: the per-kernel table of one graph-free exact
step adds up (shares to 100%, calls x mean = total, the rows' sum within the profiled step's wall time, the same
calls every step), names the step's real work (the convolutions), and the command writes what it prints; the
bench's ``--profile-batch`` prints the same table."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from code2wav.loadgen.baselines import profile_kernels
from code2wav.loadgen.profile import StepProfile, format_table, profile_step, staged_step
from code2wav.sidecar.models import load_model
from conftest import ROOT, TINY, VOXCPM2_TINY

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _check_consistent(p: StepProfile, steps: int) -> None:
    assert p.kernels and p.unit == "operator" and p.steps == steps
    assert math.isclose(sum(r.share for r in p.kernels), 1.0, abs_tol=1e-9)
    assert math.isclose(sum(r.total_us for r in p.kernels), p.total_us, rel_tol=1e-6)
    assert sum(r.calls for r in p.kernels) == p.calls
    for r in p.kernels:
        assert r.calls > 0 and r.total_us >= 0 and 0 <= r.share <= 1
        assert r.calls == int(r.calls), r  # every profiled step runs the same operators
        assert math.isclose(r.mean_us * r.calls, r.total_us, rel_tol=1e-9), r
        assert math.isclose(r.share, r.total_us / p.total_us, rel_tol=1e-9), r
    assert [r.total_us for r in p.kernels] == sorted((r.total_us for r in p.kernels), reverse=True)
    # self times of one thread's operators: together no more than the profiled steps' own wall time
    assert 0 < p.total_us <= p.profiled_step_ms * 1e3


class DispatchedOps(TorchDispatchMode):
    """Counts every operator dispatched below autograd, by name: an account of the step apart from the profiler."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_path", [TINY, VOXCPM2_TINY], ids=["qwen3-tts", "voxcpm2"])
def test_the_table_adds_up_and_names_the_steps_work(model_path):
    model = load_model(str(model_path), torch.device("cpu"), "float32")
    p = profile_step(model, batch=2, num_frames=4, steps=2, warmup=1)
    _check_consistent(p, steps=2)
    with torch.inference_mode(), DispatchedOps() as dispatched:
        staged_step(model, 2, 4)()
    by_name = {r.name: r for r in p.kernels}
    # the step's convolutions and linears: as many calls a step as the dispatcher sees in one step (not a guess)
    convs = dispatched.counts["conv1d"] + dispatched.counts["conv_transpose1d"]
    assert convs > 3 and by_name["aten::_convolution"].calls == convs
    linears = dispatched.counts["linear"]
    assert linears == (by_name["aten::linear"].calls if "aten::linear" in by_name else 0)
    assert (p.batch, p.num_frames, p.device, p.dtype) == (2, 4, "cpu", "float32")
    assert p.step_ms_p50 > 0 and p.choices == []  # no kernel choices on the CPU


def test_the_profile_command_writes_what_it_prints(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", "profile", "--model", str(TINY), "--device",
                           "cpu", "--batch", "2", "--frames", "3", "--steps", "2", "--warmup", "1", "--top", "5",
                           "--json", str(out)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"] == {"model": str(TINY), "device": "cpu", "dtype": "float32", "batch": 2, "frames": 3,
                                  "steps": 2, "warmup": 1, "top": 5, "by": "kernel",
                                  "conv_forms": None}
    assert report["environment"]["gpu"] is None
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{TINY}, float32, cpu: one exact step (no graph), batch 2 x 3 frames, mean of 2 "
                               f"profiled steps: {report['calls']:g} operator calls, {report['total_us']:.1f} us summed")
    rows = report["kernels"]
    for line, row in zip(lines[2:7], rows[:5]):  # the five top rows as printed
        assert line.split() == [f"{row['total_us']:.1f}", f"{row['calls']:g}", f"{row['mean_us']:.1f}",
                                f"{100 * row['share']:.1f}%", row["name"]]
    rest = lines[7].split()
    assert rest[-2:] == [f"({len(rows) - 5}", "more)"]
    assert float(rest[0]) == pytest.approx(sum(r["total_us"] for r in rows[5:]), abs=0.11)
    assert math.isclose(sum(r["share"] for r in rows), 1.0, abs_tol=1e-9)


def test_bad_sizes_are_a_usage_error_before_loading():
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", "profile", "--model", "/no/such/folder",
                           "--device", "cpu", "--batch", "0"], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 2
    assert "error: argument --batch: expected an integer >= 1, got '0'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_bench_profile_prints_the_same_table(tiny_model):
    text = profile_kernels(tiny_model, 2, 3, row_limit=4)
    lines = text.splitlines()
    assert lines[0].startswith(f"{tiny_model.name}, float32, cpu: one exact step (no graph), batch 2 x 3 frames")
    assert lines[1].split() == ["total", "us", "calls", "mean", "us", "share", "operator", "(self", "time)"]
    assert len(lines) == 2 + 4 + 1  # the top 4 rows, then the rest summed
    assert format_table(profile_step(tiny_model, 2, 3, steps=1, warmup=1), top=None).count("\n") > 6
