"""The attention layer's rotary embedding and cache update as one op (``sidecar/kernels/rope_cache.py``), and the
layers' shared per-step inputs as one op (``sidecar/kernels/window_inputs.py``).

CPU: the Triton kernel's own code under Triton's interpreter (a subprocess: ``TRITON_INTERPRET`` must be set before
Triton is imported) against the torch expression: heads and a head size that are not powers of two, a strided
cache (a view of the arena's rows, as the step passes it), rows whose valid lengths differ (a padding row of
length 0: its next cache is the cache it had). The expression against the plain form of the transformer is in
``tests/test_decoder.py``. CUDA: the compiled kernel against the expression, float32 and bf16. The same for the
per-step inputs: positions in the thousands (the angles' float32 rounding), rows before and past one window.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from code2wav.sidecar.kernels import rope_cache, window_inputs
from conftest import interpreted_json

HAS_TRITON = importlib.util.find_spec("triton") is not None

CASES = [  # (batch, new positions, heads, head size, cached positions, lengths)
    (2, 5, 3, 6, 4, [5, 2]),
    (3, 1, 2, 8, 7, [1, 0, 1]),  # one new position (a first chunk); a padding row
    (1, 9, 4, 4, 3, [9]),  # more new positions than cached ones
]


def _inputs(case, device="cpu", dtype=torch.float32, seed=0):
    batch, num_new, heads, dim, num_cached, lengths = case
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, num_new, 3, heads, dim, generator=gen)  # [B, T, 3, H, D]
    angles = torch.randn(batch, num_new, dim // 2, generator=gen) * 3
    angles = torch.cat([angles, angles], dim=-1)  # [B, T, D]
    sin = angles.sin()
    signed_sin = torch.cat([-sin[..., :dim // 2], sin[..., dim // 2:]], dim=-1)  # [B, T, D]
    to = dict(device=device, dtype=dtype)
    rows = torch.randn(batch, 5 + 2 * heads * num_cached * dim, generator=gen).to(**to)  # arena rows
    cache = rows[:, 5:].view(batch, 2, heads, num_cached, dim)  # [B, 2, H, P, D]: the entry at offset 5, strided
    return (qkv.to(**to), angles.cos().to(**to), signed_sin.to(**to), cache, torch.tensor(lengths, device=device))


INPUT_CASES = [  # (start positions, lengths, new positions, window, head size)
    ([0, 3], [5, 2], 5, 4, 8),  # row 0 at the stream's start: keys before position 0 are masked
    ([4093, 70], [1, 0], 1, 72, 64),  # the shipped window; positions in the thousands; a padding row
    ([130, 0, 7], [25, 25, 9], 25, 72, 6),  # a head size that is not a power of two
    ([9, 200], [200, 150], 200, 72, 4),  # more new positions than a block of mask columns (window mode's chunks)
]


def _step_inputs(case, device="cpu", dtype=torch.float32):
    starts, lengths, num_new, window, dim = case
    inv_freq = window_inputs.inverse_frequencies(dim, 10000.0, torch.device(device))
    return (torch.tensor(starts, device=device), torch.tensor(lengths, device=device), inv_freq, num_new, window,
            dtype)


def _max_err(got, ref) -> float:
    return max((g.float() - r.float()).abs().max().item() for g, r in zip(got, ref))


INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from code2wav.sidecar.kernels import rope_cache, window_inputs
from test_rope_cache import CASES, _inputs, _max_err
from test_rope_cache import INPUT_CASES, _step_inputs
from code2wav.sidecar.kernels import window_inputs
out = []
for case in CASES:
    args = _inputs(case)
    strided = torch.stack([args[4], torch.full_like(args[4], 99)], dim=1)[:, 0]  # lengths as a strided slice
    for lengths in (args[4], strided):
        got, ref = rope_cache.run_interpreted(*args[:4], lengths), rope_cache.reference(*args)
        out.append([_max_err(got, ref), [list(t.shape) for t in got] == [list(t.shape) for t in ref]])
for case in INPUT_CASES:
    args = _step_inputs(case)
    got, ref = window_inputs.run_interpreted(*args), window_inputs.reference(*args)
    same = [list(t.shape) for t in got] == [list(t.shape) for t in ref] and all(
        g.dtype == r.dtype for g, r in zip(got, ref))
    out.append([_max_err(got, ref), same])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_kernel_matches_the_torch_expression_under_the_interpreter():
    results = interpreted_json(INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(results) == 2 * len(CASES) + len(INPUT_CASES)
    for case, (err, same_shapes) in zip([c for c in CASES for _ in range(2)] + INPUT_CASES, results):
        assert same_shapes, case
        assert err < 1e-6, (case, err)


def test_reference_joins_the_cache_and_takes_each_rows_window():
    """The expression's parts, checked by hand: q and k rotated, v as it is, the cache in front, and the next cache
    the ``P`` positions ending at each row's last valid one."""
    args = _inputs(CASES[0])
    qkv, cos, signed_sin, cache, lengths = args
    q, kv, next_cache = rope_cache.reference(*args)
    half = qkv.shape[-1] // 2
    q_in = qkv[:, :, 0]  # [B, T, H, D]
    swapped = torch.cat([q_in[..., half:], q_in[..., :half]], dim=-1)
    assert torch.allclose(q, q_in * cos[:, :, None] + swapped * signed_sin[:, :, None], atol=1e-6)
    num_cached = cache.shape[3]
    assert torch.equal(kv[:, :, :, :num_cached], cache)
    assert torch.equal(kv[:, 1, :, num_cached:], qkv[:, :, 2].transpose(1, 2))
    for b, length in enumerate(lengths.tolist()):
        assert torch.equal(next_cache[b], kv[b, :, :, length:length + num_cached])


def test_the_cache_stays_a_strided_view_of_arena_rows_and_lengths_may_be_strided():
    """As the step passes them: the cache a view across rows (the kernel reads its strides), and lengths a slice."""
    args = _inputs(CASES[0])
    assert not args[3].is_contiguous()
    lengths = torch.tensor([5, 9, 2])[::2]  # [5, 2], not contiguous
    assert torch.equal(rope_cache.reference(*args[:4], lengths)[2], rope_cache.reference(*args)[2])


def test_shapes_are_checked_with_what_was_expected():
    qkv, cos, signed_sin, cache, lengths = _inputs(CASES[0])
    with pytest.raises(ValueError, match=r"cos and signed_sin \[B, T, D\]"):
        torch.ops.code2wav.rope_kv_cache(qkv, cos[:, :1], signed_sin, cache, lengths)
    with pytest.raises(ValueError, match=r"cache \[B, 2, H, P, D\]"):
        torch.ops.code2wav.rope_kv_cache(qkv, cos, signed_sin, cache[:, :1], lengths)
    with pytest.raises(ValueError, match=r"D even"):
        torch.ops.code2wav.rope_kv_cache(qkv[..., :5], cos, signed_sin, cache, lengths)


@pytest.mark.cuda
def test_cuda_kernel_matches_the_torch_expression():
    """float32: the same numbers up to the order of one multiply-add; bf16: float32 math and one rounding, so within
    a bf16 step of the float32 expression of the same bf16 inputs."""
    for case in CASES:
        args = _inputs(case, device="cuda")
        assert _max_err(torch.ops.code2wav.rope_kv_cache(*args), rope_cache.reference(*args)) < 1e-6, case
        bf = _inputs(case, device="cuda", dtype=torch.bfloat16)
        exact = rope_cache.reference(*(a.float() if a.is_floating_point() else a for a in bf))
        got = torch.ops.code2wav.rope_kv_cache(*bf)
        assert all(g.dtype == torch.bfloat16 for g in got)
        assert _max_err(got, exact) <= 0.0079 * max(1.0, max(e.abs().max().item() for e in exact)), case


def test_step_inputs_are_the_transformers_own_expressions():
    """The op's expression against the pieces the transformer's torch forms use, checked by hand for the mask."""
    starts, lengths, inv_freq, num_new, window, dtype = _step_inputs(INPUT_CASES[0])
    cos, signed_sin, mask, index = torch.ops.code2wav.window_inputs(starts, lengths, inv_freq, num_new, window, dtype)
    positions = starts[:, None] + torch.arange(num_new)[None, :]  # [B, T]
    angles = positions.float()[:, :, None] * inv_freq  # [B, T, D/2]
    assert torch.equal(cos, torch.cat([angles.cos(), angles.cos()], dim=-1))
    assert torch.equal(signed_sin, torch.cat([-angles.sin(), angles.sin()], dim=-1))
    for b, start in enumerate(starts.tolist()):
        for t in range(num_new):
            for k in range(window - 1 + num_new):
                key = start - (window - 1) + k
                assert mask[b, 0, t, k].item() == (0 <= key and start + t - window < key <= start + t)
    assert index[:, 0, 0, :, 0].tolist() == [[n + j for j in range(window - 1)] for n in lengths.tolist()]


def test_step_inputs_shapes_are_checked():
    starts, lengths, inv_freq, num_new, window, dtype = _step_inputs(INPUT_CASES[0])
    with pytest.raises(ValueError, match=r"start_positions and lengths \[B\]"):
        torch.ops.code2wav.window_inputs(starts, lengths[:1], inv_freq, num_new, window, dtype)
    with pytest.raises(ValueError, match=r"inv_freq \[D/2\] float32"):
        torch.ops.code2wav.window_inputs(starts, lengths, inv_freq.double(), num_new, window, dtype)


@pytest.mark.cuda
def test_cuda_step_inputs_match_the_torch_expression():
    """The mask and the cache index exactly; cos and the signed sine: the same float32 angles, and CUDA's cosf/sinf
    in both (within one rounding of the output dtype where they differ)."""
    for case in INPUT_CASES:
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 0.0079)):
            args = _step_inputs(case, device="cuda", dtype=dtype)
            got, ref = torch.ops.code2wav.window_inputs(*args), window_inputs.reference(*args)
            assert [g.dtype for g in got] == [r.dtype for r in ref], case
            assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3]), case
            assert _max_err(got[:2], ref[:2]) <= tol, (case, dtype)
