"""The float32 GEMM on tensor cores (``sidecar/kernels/matmul.py``: 3xTF32) and its per-shape choice.

CPU: the kernel's own code under Triton's interpreter (a subprocess: ``TRITON_INTERPRET`` must be set before Triton is
imported) against the torch expression, with partial tiles at every edge, transposed operands, a periodic bias and
accumulation into a strided ``out``; the choice's policy (cuBLAS wherever the kernel is not offered) and the
channels-last rows view; the family switch reaching every choice.
CUDA: the compiled kernel in every tile shape against float64, held to float32 cuBLAS's own error (one TF32 pass
would be ~1000x worse); the choice measured on the device; the 48 kHz decoder streaming with every GEMM forced onto
the kernel against the same decoder on torch ops.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from code2wav.sidecar.kernels import matmul, matmul_choice
from conftest import interpreted_json

HAS_TRITON = importlib.util.find_spec("triton") is not None

CASES = [  # (rows, depth, cols, bias period or 0, accumulate, transpose b)
    (37, 48, 40, 0, False, False),  # partial tiles in every dimension (depth not a multiple of the tile's)
    (64, 32, 48, 16, False, False),  # a bias shared by 3 phases (a transposed conv's s C_out columns)
    (50, 40, 24, 0, True, True),  # accumulate (a residual); b transposed, as a 1x1 conv's weight.t()
    (5, 16, 16, 16, True, False),  # fewer rows than a tile
]


def _inputs(case, device="cpu", seed=0):
    rows, depth, cols, period, accumulate, transpose_b = case
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, depth + 3, generator=gen)[:, 2:2 + depth]  # strided rows
    b = torch.randn(cols, depth, generator=gen).t() if transpose_b else torch.randn(depth, cols, generator=gen)
    bias = torch.randn(period, generator=gen) if period else None
    out = torch.randn(cols, rows, generator=gen).t()  # column-major: a strided out
    return (out.to(device), a.to(device), b.to(device), None if bias is None else bias.to(device), accumulate)


INTERPRETED = """
import json, sys
import torch
from code2wav.sidecar.kernels import matmul
sys.path.insert(0, {tests!r})
from test_matmul import CASES, _inputs
result = []
for case in CASES:
    out, a, b, bias, accumulate = _inputs(case)
    expected = out.clone()
    matmul.reference(expected, a, b, bias, accumulate)
    matmul.run_interpreted(out, a, b, bias, accumulate)
    result.append((out - expected).abs().max().item())
print(json.dumps(result))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_the_kernel_indexing_matches_the_torch_expression_under_the_interpreter():
    errors = interpreted_json(INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(errors) == len(CASES)
    for case, err in zip(CASES, errors):
        assert err < 1e-4, (case, err)  # sums of up to 48 products of N(0, 1): float32 rounding is ~1e-6


def test_the_cpu_op_is_the_torch_expression_and_rejects_other_shapes():
    out, a, b, bias, accumulate = _inputs(CASES[2])
    expected = out + a @ b
    torch.ops.code2wav.mm_3xtf32_(out, a, b, bias, accumulate, list(matmul.CONFIGS[0]))
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match=r"a \[M, K\], b \[K, N\]"):
        torch.ops.code2wav.mm_3xtf32_(out, a, b.t(), None, False, list(matmul.CONFIGS[0]))
    out, a, b, _, _ = _inputs(CASES[1])
    with pytest.raises(ValueError, match="P dividing N = 48"):
        torch.ops.code2wav.mm_3xtf32_(out, a, b, torch.zeros(5), False, list(matmul.CONFIGS[0]))
    meta = dict(device="meta")  # shapes only (the fake implementation checks them too)
    far = torch.empty_strided((4, 2 ** 12), (1, 2 ** 20), **meta)  # columns 2^20 elements apart: past int32
    with pytest.raises(ValueError, match="offsets within a's columns reach 2"):
        torch.ops.code2wav.mm_3xtf32_(torch.empty(4, 2, **meta), far, torch.empty(2 ** 12, 2, **meta), None, False,
                                      list(matmul.CONFIGS[0]))


def test_the_flop_counter_counts_the_op_as_the_gemm_it_is():
    from torch.utils.flop_counter import FlopCounterMode

    out, a, b, bias, accumulate = _inputs(CASES[0])
    with FlopCounterMode(display=False) as counter:
        torch.ops.code2wav.mm_3xtf32_(out, a, b, bias, accumulate, list(matmul.CONFIGS[0]))
    assert counter.get_total_flops() == 2 * 37 * 48 * 40


def test_the_choice_runs_cublas_wherever_the_kernel_is_not_offered():
    choice = matmul_choice.MatmulChoice()
    choice.kernels = True
    out, a, b, bias, accumulate = _inputs(CASES[1])
    expected = out.clone()
    matmul.reference(expected, a, b, bias, accumulate)
    assert not choice.offers_kernel(a)  # a CPU tensor
    torch.testing.assert_close(choice(out, a, b, bias, accumulate), expected)
    assert choice.decisions == {}  # nothing measured
    if torch.cuda.is_available():
        half = torch.zeros(2, 2, device="cuda", dtype=torch.bfloat16)
        assert not choice.offers_kernel(half)  # bf16 GEMMs already run on tensor cores in cuBLAS
        with torch.enable_grad():
            assert not choice.offers_kernel(half.float())  # no backward
        choice.kernels = False
        assert not choice.offers_kernel(half.float())


def test_rows_is_a_view_of_channels_last_tensors_only():
    x = torch.randn(3, 4, 5)  # [B, C, T] contiguous: no rows view
    assert matmul_choice.rows(x) is None
    cl = x.transpose(1, 2).contiguous().transpose(1, 2)  # channels-last
    r = matmul_choice.rows(cl)
    assert r.shape == (15, 4) and r.data_ptr() == cl.data_ptr()
    torch.testing.assert_close(r[5], cl[1, :, 0])  # row b * T + t is column t of row b
    assert matmul_choice.rows(cl[:, :, 1:]) is None  # a slice of the columns is not one block of rows


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("batch, num_frames", [(2, 9), (1, 9), (3, 1)])
def test_residual_matmul_adds_the_1x1_conv_in_place(monkeypatch, channels_last, batch, num_frames):
    """Channels-last tensors where the kernel is offered go through the choice as one GEMM over ``[B T, C]`` rows
    (on CPU the op is its torch expression; the offer and the measurement are forced), others through ``baddbmm``."""
    measured = []

    def measure(self, key, forms, out, a, b, bias, accumulate):
        measured.append((key, a.data_ptr(), out.data_ptr()))
        self.decisions[key] = "x3_0"
        return "x3_0"

    monkeypatch.setattr(matmul_choice.MatmulChoice, "offers_kernel", lambda self, t: True)
    monkeypatch.setattr(matmul_choice.MatmulChoice, "measure", measure)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has no CUDA)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 6, num_frames, generator=gen)
    h = torch.randn(batch, 6, num_frames, generator=gen)
    if channels_last:
        x, h = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, h))
    weight = torch.randn(6, 6, generator=gen)
    expected = x + torch.einsum("oc,bct->bot", weight, h)
    ptr = x.data_ptr()
    got = matmul_choice.residual_matmul_(x, weight, h, matmul_choice.MatmulChoice())
    assert got.data_ptr() == ptr
    torch.testing.assert_close(got, expected)
    if channels_last or num_frames == 1:  # one frame: [B, C, 1] is channels-last whatever its strides say
        (key, a_ptr, out_ptr), = measured
        assert key[0] == (batch * num_frames, 6) and (a_ptr, out_ptr) == (h.data_ptr(), ptr)  # views, no copies
        assert key[2:5] == ((6, 1), (1, 6), (6, 1))  # h's rows, the weight transposed (a view), x's rows
    else:
        assert measured == []


@pytest.mark.parametrize("spec", ["default", "voxcpm2-default"])
def test_the_family_switch_reaches_every_gemm_choice(spec):
    from code2wav.sidecar.models import load_model

    model = load_model(spec, torch.device("cpu"), "float32")
    choices = matmul_choice.matmul_choices(model.module)
    # every residual unit's 1x1 conv and every upsampling transposed conv (kernel 2 x stride) holds one
    expected = 4 * 3 + 4 if spec == "default" else 6 * 3 + 6
    assert len(choices) == expected
    model.family.use_fused_kernels(model.module, True)
    assert all(c.kernels == (matmul.triton is not None) for c in choices)
    model.family.use_fused_kernels(model.module, False)
    assert not any(c.kernels for c in choices)


def test_the_bench_can_put_every_gemm_on_cublas_and_back():
    """The bench's ``exact-graph-cublas-*`` rows: inside ``cublas_gemms`` no GEMM choice offers the kernel; after it,
    each is as it was."""
    from code2wav.loadgen.baselines import cublas_gemms
    from code2wav.sidecar.models import load_model

    model = load_model("voxcpm2-default", torch.device("cpu"), "float32")
    choices = matmul_choice.matmul_choices(model.module)
    assert len(choices) == 24
    choices[0].kernels = True  # as use_fused_kernels sets them on CUDA; one left off
    with cublas_gemms(model.module):
        assert not any(c.kernels for c in choices)
    assert [c.kernels for c in choices] == [True] + [False] * 23


# ----------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("index", range(len(matmul.CONFIGS)))
def test_cuda_kernel_is_as_accurate_as_float32_cublas(no_tf32, index):
    config = matmul.CONFIGS[index]
    gen = torch.Generator().manual_seed(index)
    for rows, depth, cols, period, accumulate in ((1000, 1024, 384, 128, False), (777, 96, 40, 0, True)):
        a = torch.randn(rows, depth, generator=gen).cuda()
        b = (torch.randn(depth, cols, generator=gen) / depth ** 0.5).cuda()
        bias = torch.randn(period, generator=gen).cuda() if period else None
        start = torch.randn(rows, cols, generator=gen).cuda()
        exact = start.double().clone()
        matmul.reference(exact, a.double(), b.double(), None if bias is None else bias.double(), accumulate)
        got = start.clone()
        torch.ops.code2wav.mm_3xtf32_(got, a, b, bias, accumulate, list(config))
        library = start.clone()
        matmul_choice.cublas(library, a, b, bias, accumulate)  # IEEE float32 (TF32 off)
        err = (got.double() - exact).abs().max().item()
        library_err = (library.double() - exact).abs().max().item()
        assert err <= 4 * library_err + 1e-7, (config, rows, depth, err, library_err)


@cuda
def test_cuda_choice_measures_the_forms_once_per_shape(no_tf32):
    choice = matmul_choice.MatmulChoice()
    choice.kernels = True
    a = torch.randn(4096, 512, device="cuda")
    b = torch.randn(512, 256, device="cuda") / 512 ** 0.5
    out = torch.empty(4096, 256, device="cuda")
    with torch.no_grad():
        choice(out, a, b)
        choice(out, a, b)
    assert len(choice.decisions) == 1
    (timings,) = choice.timings_ms.values()
    assert set(timings) == {"cublas"} | {f"x3_{i}" for i in range(len(matmul.CONFIGS))}, timings
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5)


@cuda
def test_the_48khz_decoder_streams_the_same_with_every_gemm_on_the_kernel(no_tf32, monkeypatch):
    """The decoder with its fused kernels and every GEMM forced onto the 3xTF32 kernel (its tiles in turn) against
    the same decoder on torch ops, as ``test_kernels.test_decoders_stream_the_same_with_fused_kernels`` compares them."""
    from test_kernels import _chunks, _stream

    from code2wav.sidecar.models import load_model

    forced = []

    def measure(self, key, forms, *args):  # the tiles in turn
        form = f"x3_{len(forced) % len(matmul.CONFIGS)}"
        forced.append(key)
        self.decisions[key] = form
        return form

    monkeypatch.setattr(matmul_choice.MatmulChoice, "measure", measure)
    model = load_model("voxcpm2-default", torch.device("cuda"), "float32")
    assert model.fused_kernels
    chunks = _chunks(model, [(4, [4, 4]), (25, [25, 3])], seed=3)
    with torch.no_grad():
        kernel_audio, _ = _stream(model, chunks)
    choices = matmul_choice.matmul_choices(model.module)
    assert len(choices) == 24 and all(c.decisions for c in choices)  # 6 transposed convs, 18 residual GEMMs
    assert len(forced) == 24 * 2  # each GEMM at both chunk shapes
    model.family.use_fused_kernels(model.module, False)
    with torch.no_grad():
        plain_audio, _ = _stream(model, chunks)
    for got, ref in zip(kernel_audio, plain_audio):
        assert (got - ref).abs().max().item() < 2e-5
