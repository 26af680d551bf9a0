"""A stateful conv's input joined to its state, and its next state, as one op (``sidecar/kernels/state_cat.py``).

CPU: the Triton kernel's own code under Triton's interpreter (a subprocess: ``TRITON_INTERPRET`` must be set before
Triton is imported) against the torch expression: a strided state (a view of the arena's rows, as the step passes
it), ``x`` with its channels contiguous (as a transposed conv leaves it), more state columns than new ones, rows whose
valid lengths differ (0: the tail is the state it had), blocks of channels and columns that do not divide. Both
families streaming the goldens with the op: ``tests/test_fused_paths_cpu.py``. CUDA: the compiled kernel, float32
and bf16 (a float32 state cast to bf16 inputs, as a bf16 arena is not).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from code2wav.sidecar.kernels import state_cat
from conftest import interpreted_json

HAS_TRITON = importlib.util.find_spec("triton") is not None

CASES = [  # (batch, channels, new columns, state columns, lengths, x channels-last)
    (2, 5, 7, 6, [7, 3], False),
    (3, 40, 1, 2, [1, 0, 1], True),  # one new column; a padding row; channels over one block
    (1, 3, 70, 6, [70], False),  # columns over one block
    (2, 4, 2, 54, [2, 1], True),  # more state columns than new ones (a dilated conv's tail)
]


def _inputs(case, device="cpu", dtype=torch.float32, state_dtype=None, seed=0):
    batch, channels, num_cols, num_state, lengths, channels_last = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, num_cols, generator=gen).to(device=device, dtype=dtype)  # [B, C, T]
    if channels_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, channels contiguous
    rows = torch.randn(batch, 3 + channels * num_state, generator=gen).to(device=device, dtype=state_dtype or dtype)
    state = rows[:, 3:].view(batch, channels, num_state)  # [B, C, P]: arena rows' entry at offset 3, strided
    return x, state, torch.tensor(lengths, device=device)


INTERPRETED = """
import json, sys
sys.path.insert(0, {tests!r})
from code2wav.sidecar.kernels import state_cat
from test_state_cat import CASES, _inputs
out = []
for case in CASES:
    args = _inputs(case)
    got, ref = state_cat.run_interpreted(*args), state_cat.reference(*args)
    same = all(g.shape == r.shape and g.is_contiguous() for g, r in zip(got, ref))
    out.append([max((g - r).abs().max().item() for g, r in zip(got, ref)), same])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_kernel_matches_the_torch_expression_under_the_interpreter():
    results = interpreted_json(INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(results) == len(CASES)
    for case, (err, same) in zip(CASES, results):
        assert same, case
        assert err == 0.0, (case, err)  # copies only


def test_reference_is_the_join_and_each_rows_window():
    x, state, lengths = _inputs(CASES[0])
    x_cat, tail = state_cat.reference(x, state, lengths)
    num_state = state.shape[2]
    assert torch.equal(x_cat[:, :, :num_state], state) and torch.equal(x_cat[:, :, num_state:], x)
    for b, length in enumerate(lengths.tolist()):
        assert torch.equal(tail[b], x_cat[b, :, length:length + num_state])


def test_shapes_are_checked_with_what_was_expected():
    x, state, lengths = _inputs(CASES[0])
    with pytest.raises(ValueError, match=r"state \[B, C, P\] with P >= 1"):
        torch.ops.code2wav.state_cat(x, state[:, :2], lengths)
    with pytest.raises(ValueError, match=r"lengths \[B\] = \[2\]"):
        torch.ops.code2wav.state_cat(x, state, lengths[:1])


@pytest.mark.cuda
def test_cuda_kernel_matches_the_torch_expression():
    for case in CASES:
        for dtype, state_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)):
            args = _inputs(case, device="cuda", dtype=dtype, state_dtype=state_dtype)
            assert case[0] == 1 or not args[1].is_contiguous()  # one row of the arena is contiguous, more are not
            got, ref = torch.ops.code2wav.state_cat(*args), state_cat.reference(*args)
            for g, r in zip(got, ref):
                assert g.dtype == dtype and torch.equal(g, r), (case, dtype, state_dtype)
