"""A transformer layer's residual add with the norm after it, and its MLP gate, as one op each
(``sidecar/kernels/layer_glue.py``).

CPU: each Triton kernel's own code under Triton's interpreter (a subprocess: ``TRITON_INTERPRET`` must be set before
Triton is imported) against the torch expression, with row sizes that are not powers of two, the shipped ones, and a
gate wider than one program's block; the expressions checked by hand; shapes refused with what was expected. The ops
inside the transformer against its plain form: ``tests/test_decoder.py``. CUDA: the compiled kernels against the
expressions, float32 and bf16.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from code2wav.sidecar.kernels import layer_glue
from conftest import interpreted_json

HAS_TRITON = importlib.util.find_spec("triton") is not None

NORM_CASES = [(3, 7), (25, 512), (2, 37), (1, 1)]  # (rows, C): odd sizes, the shipped hidden size at 25 frames
GATE_CASES = [(3, 7), (25, 1024), (2, layer_glue.MAX_GATE_BLOCK + 300)]  # (rows, I): the last spans two blocks
EPS = 1e-5


def _norm_inputs(case, device="cpu", dtype=torch.float32, seed=0):
    rows, cols = case
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(rows, cols, generator=gen) * 3
    x = torch.randn(rows, cols, generator=gen)
    scale = torch.rand(cols, generator=gen) * 0.1
    weight = torch.rand(cols, generator=gen) + 0.5
    return tuple(t.to(device=device, dtype=dtype) for t in (residual, x, scale, weight))


def _gate_input(case, device="cpu", dtype=torch.float32, seed=0):
    rows, cols = case
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * cols, generator=gen) * 4).to(device=device, dtype=dtype)  # [rows, 2I]


def _max_err(got, ref) -> float:
    return max((g.float() - r.float()).abs().max().item() for g, r in zip(got, ref))


def _max_rel_err(got, ref) -> float:
    """Largest error relative to the reference's size (at least 1): the kernels' division, sqrt and exp are the GPU's
    approximate ones (a few ulp), and the gate's outputs reach the hundreds."""
    return max(((g.float() - r.float()).abs() / r.float().abs().clamp(min=1.0)).max().item() for g, r in zip(got, ref))


INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from code2wav.sidecar.kernels import layer_glue
from test_layer_glue import EPS, GATE_CASES, NORM_CASES, _gate_input, _max_err, _norm_inputs
out = []
for case in NORM_CASES:
    args = _norm_inputs(case)
    got, ref = layer_glue.run_interpreted_norm(*args, EPS), layer_glue.add_rms_norm_reference(*args, EPS)
    out.append([_max_err(got, ref), [list(t.shape) for t in got] == [list(t.shape) for t in ref]])
    rows, cols = case  # the same op on [B, T, C] rows of a strided x (a view, as a GEMM output slice may be)
    wide = torch.cat([args[1], args[1]], dim=-1)[:, :cols]
    got = layer_glue.run_interpreted_norm(args[0], wide, args[2], args[3], EPS)
    out.append([_max_err(got, ref), not wide.is_contiguous() or cols == 1])
for case in GATE_CASES:
    gate_up = _gate_input(case)
    got, ref = layer_glue.run_interpreted_gate(gate_up), layer_glue.silu_mul_reference(gate_up)
    out.append([_max_err([got], [ref]), list(got.shape) == list(ref.shape)])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_kernels_match_the_torch_expressions_under_the_interpreter():
    results = interpreted_json(INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(results) == 2 * len(NORM_CASES) + len(GATE_CASES)
    cases = [c for c in NORM_CASES for _ in range(2)] + GATE_CASES
    for case, (err, same) in zip(cases, results):
        assert same, case
        assert err < 1e-5, (case, err)


def test_the_expressions_are_the_transformers_own_steps():
    """The norm's expression is ``addcmul`` then ``F.rms_norm`` of what it stored; the gate's, ``silu(gate) * up``."""
    residual, x, scale, weight = _norm_inputs(NORM_CASES[1])
    h, normed = layer_glue.add_rms_norm_reference(residual, x, scale, weight, EPS)
    assert torch.allclose(h, torch.addcmul(residual, scale, x), atol=1e-6)
    assert torch.allclose(normed, F.rms_norm(h, (h.shape[-1],), weight, EPS), atol=1e-5)
    bf = [t.bfloat16() for t in (residual, x, scale, weight)]
    h_bf, normed_bf = layer_glue.add_rms_norm_reference(*bf, EPS)
    assert h_bf.dtype == normed_bf.dtype == torch.bfloat16
    expected = F.rms_norm(h_bf.float(), (h.shape[-1],), bf[3].float(), EPS)  # float32 math on the rounded h
    assert ((normed_bf.float() - expected).abs() <= 0.0079 * expected.abs().clamp(min=1.0)).all()  # one bf16 step
    gate_up = _gate_input(GATE_CASES[1])
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(layer_glue.silu_mul_reference(gate_up), F.silu(gate) * up, atol=1e-6)


def test_ops_keep_leading_dimensions_and_check_shapes():
    residual, x, scale, weight = (t[None] if t.dim() == 2 else t for t in _norm_inputs(NORM_CASES[0]))  # [1, 3, 7]
    h, normed = torch.ops.code2wav.add_rms_norm(residual, x, scale, weight, EPS)
    assert h.shape == normed.shape == residual.shape
    assert torch.ops.code2wav.silu_mul(_gate_input(GATE_CASES[0])[None]).shape == (1, 3, 7)
    with pytest.raises(ValueError, match=r"residual and x of one shape \[\.\.\., C\]"):
        torch.ops.code2wav.add_rms_norm(residual, x[..., :5], scale, weight, EPS)
    with pytest.raises(ValueError, match=r"scale and weight \[C\] = \[7\]"):
        torch.ops.code2wav.add_rms_norm(residual, x, scale[:5], weight, EPS)
    with pytest.raises(ValueError, match=r"gate_up \[\.\.\., 2I\]"):
        torch.ops.code2wav.silu_mul(torch.zeros(2, 5))


@pytest.mark.cuda
def test_cuda_kernels_match_the_torch_expressions():
    """float32: the same numbers up to the order of a sum and the GPU's approximate division, sqrt and exp (a few ulp
    of each output, relative: the gate's outputs reach the hundreds); bf16: float32 math and one rounding each, so
    within a bf16 step of the float32 expression of the same bf16 inputs."""
    for case in NORM_CASES:
        args = _norm_inputs(case, device="cuda")
        got = torch.ops.code2wav.add_rms_norm(*args, EPS)
        assert _max_rel_err(got, layer_glue.add_rms_norm_reference(*args, EPS)) < 1e-5, case
        bf = _norm_inputs(case, device="cuda", dtype=torch.bfloat16)
        got = torch.ops.code2wav.add_rms_norm(*bf, EPS)
        ref = layer_glue.add_rms_norm_reference(*bf, EPS)  # (float32 math on the same bf16 inputs, rounded once)
        assert all(g.dtype == torch.bfloat16 for g in got)
        assert _max_err(got, ref) <= 0.0079 * max(1.0, max(r.abs().max().item() for r in ref)), case
    for case in GATE_CASES:
        gate_up = _gate_input(case, device="cuda")
        got = torch.ops.code2wav.silu_mul(gate_up)
        assert _max_rel_err([got], [layer_glue.silu_mul_reference(gate_up)]) < 1e-5, case
        bf = _gate_input(case, device="cuda", dtype=torch.bfloat16)
        got, ref = torch.ops.code2wav.silu_mul(bf), layer_glue.silu_mul_reference(bf)
        assert got.dtype == torch.bfloat16
        assert _max_err([got], [ref]) <= 0.0079 * max(1.0, ref.abs().max().item()), case
