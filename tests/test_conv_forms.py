"""The newer forms of a dense conv (``sidecar/kernels/conv_forms.py``), their choice's cache and its counts.

CPU: cuBLAS over an im2col copy equals ``conv1d``; the channels-last implicit-GEMM Triton kernel's indexing under
Triton's interpreter equals ``conv1d`` (+ Snake) for channels-last and other inputs, blocks that divide the input
channels and ones that do not; its CPU op is the reference; the same for the TMA kernel (its descriptors' edges, a
channels-last view inside longer rows, both accumulators); the choice cache round-trips, keeps GPUs and versions
apart and ignores a damaged file; a cached choice is used without measuring, and the fallbacks are counted and
exported. CUDA: every form at the decoders' own layer shapes, including 1 and 4 frames and batches 1, 3 and 64,
against the float32 conv; a second server start reads the choices instead of measuring.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry, generate_latest

from code2wav.sidecar.kernel_metrics import KernelChoiceCollector
from code2wav.sidecar.kernels import conv_forms, conv_gemm_cl, conv_im2col, snake_math
from code2wav.sidecar.kernels.choice_cache import ChoiceCache, ChoiceEvents, geometry, shape_key
from code2wav.sidecar.kernels.conv_choice import MAX_MEASURED_SHAPES, ConvChoice

HAS_TRITON = conv_gemm_cl.triton is not None
IDENTITY = {"format": 1, "gpu": "test GPU", "capability": "9.0", "torch": "x", "tiles": [[1, 2]]}


@pytest.mark.parametrize("batch, c_in, c_out, ksize, dilation, num_cols, bias, cl", [
    (2, 8, 6, 7, 1, 30, True, False),
    (3, 16, 5, 7, 9, 1, False, True),  # one output column
    (1, 4, 4, 3, 3, 17, True, True),
])
def test_im2col_equals_conv1d(batch, c_in, c_out, ksize, dilation, num_cols, bias, cl):
    gen = torch.Generator().manual_seed(num_cols)
    x = torch.randn(batch, c_in, num_cols + (ksize - 1) * dilation, generator=gen)
    if cl:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # as a Snake kernel writes it
    weight = torch.randn(c_out, c_in, ksize, generator=gen)
    b = torch.randn(c_out, generator=gen) if bias else None
    got = conv_im2col.im2col_conv(x, conv_im2col.gemm_weight(weight), b, ksize, dilation)
    ref = F.conv1d(x, weight, b, dilation=dilation)
    assert got.shape == ref.shape and got.stride(1) == 1  # channels-last view
    assert (got - ref).abs().max().item() < 1e-4
    assert conv_im2col.copy_nbytes(tuple(x.shape), ksize, dilation, 4) == batch * num_cols * ksize * c_in * 4


CL_CASES = [  # (batch, C_in, C_out, output columns, kernel size, dilation, Snake after: None | log_params, layout)
    (2, 32, 36, 70, 7, 3, True, "cl"),  # partial tiles on every edge but the channels (16 divides 32)
    (1, 24, 16, 1, 7, 9, False, "cl"),  # one output column (a first chunk); 24 channels: a partial channel block
    (3, 16, 17, 40, 3, 1, None, "cf"),  # a channels-first input (copied to channels-last first)
]


def _cl_inputs(case):
    batch, c_in, c_out, num_cols, ksize, dilation, act, layout = case
    gen = torch.Generator().manual_seed(num_cols + c_in)
    x = torch.randn(batch, c_in, num_cols + (ksize - 1) * dilation, generator=gen)
    if layout == "cl":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "cl_view":  # channels-last, 3 columns into each row of a longer buffer
        wide = torch.zeros(batch, x.shape[2] + 3, c_in)  # [B, L + 3, C_in]
        wide[:, 3:] = x.transpose(1, 2)
        x = wide.transpose(1, 2)[:, :, 3:]
    weight = torch.randn(c_out, c_in, ksize, generator=gen) / (c_in * ksize) ** 0.5
    bias = torch.randn(c_out, generator=gen)
    alpha, beta = torch.randn(2, c_out, generator=gen) * 0.3 + (0.0 if act else 1.0)
    params = (None, None, False) if act is None else (alpha, beta, act)
    return x, weight, bias, dilation, *params


CL_INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_conv_forms import CL_CASES, _cl_inputs
from code2wav.sidecar.kernels import conv_gemm, conv_gemm_cl
out = []
for case in CL_CASES:
    x, weight, *rest = _cl_inputs(case)
    got = conv_gemm_cl.run_interpreted(x, conv_gemm_cl.kernel_weight(weight), *rest)
    ref = conv_gemm.reference(x, weight, *rest)
    out.append([list(got.shape) == list(ref.shape), got.is_contiguous(), (got - ref).abs().max().item()])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_the_channels_last_gemm_kernel_indexing_matches_conv1d_under_the_interpreter():
    from conftest import interpreted_json

    results = interpreted_json(CL_INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(results) == len(CL_CASES)
    for case, (same_shape, contiguous, err) in zip(CL_CASES, results):
        assert same_shape and contiguous and err < 1e-5, (case, err)


TMA_CASES = CL_CASES + [  # the TMA kernel's own edges: a channels-last view whose batch stride is not L rows
    (3, 16, 24, 33, 7, 1, True, "cl_view"),  # 24 channels: the second accumulator (16 + 16) half past C_out
    (2, 8, 40, 9, 7, 3, False, "cl"),  # 8 channels: one tap's tile is all of C_in, 40 = 16 + 16 + 8
]

TMA_INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_conv_forms import TMA_CASES, _cl_inputs
from code2wav.sidecar.kernels import conv_gemm, conv_gemm_tma
out = []
for case in TMA_CASES:
    x, weight, *rest = _cl_inputs(case)
    ref = conv_gemm.reference(x, weight, *rest)
    for config in (conv_gemm_tma.TmaTile(16, 16, 16, 16, 1, 1), conv_gemm_tma.TmaTile(16, 0, 32, 8, 1, 1)):
        got = conv_gemm_tma.run_interpreted(x, conv_gemm_tma.kernel_weight(weight), *rest, config=config)
        out.append([list(got.shape) == list(ref.shape), got.is_contiguous(), (got - ref).abs().max().item()])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_the_tma_gemm_kernel_indexing_matches_conv1d_under_the_interpreter():
    """Rows past an input row's end and weight rows past a tap's channels only reach outputs never stored; channels
    past C_in read zeros; both accumulators land on their own channels."""
    from conftest import interpreted_json

    results = interpreted_json(TMA_INTERPRETED.format(tests=os.path.dirname(__file__)))
    assert len(results) == 2 * len(TMA_CASES)
    for i, (same_shape, contiguous, err) in enumerate(results):
        assert same_shape and contiguous and err < 1e-5, (TMA_CASES[i // 2], i % 2, err)


def test_the_tma_gemm_cpu_op_is_the_reference_and_reads_any_layout():
    from code2wav.sidecar.kernels import conv_gemm, conv_gemm_tma

    for case in TMA_CASES:
        x, weight, bias, dilation, alpha, beta, log_params = _cl_inputs(case)
        y = torch.ops.code2wav.conv_snake_tma(x, weight, bias, dilation, alpha, beta, log_params,
                                              [16, 16, 16, 16, 1, 1])
        assert torch.equal(y, conv_gemm.reference(x, weight, bias, dilation, alpha, beta, log_params).contiguous())
    x = torch.zeros(2, 16, 40).transpose(1, 2).contiguous().transpose(1, 2)
    assert conv_gemm_tma.tma_ok(x) and not conv_gemm_tma.tma_ok(x.contiguous())  # channels-first: copied
    view = torch.zeros(2, 45, 16).transpose(1, 2)[:, :, 5:]  # [B, C, L] after 5 columns of a longer row
    assert conv_gemm_tma.tma_ok(view) and not conv_gemm_tma.tma_ok(torch.zeros(2, 45, 12).transpose(1, 2))


def test_the_channels_last_gemm_cpu_op_is_the_reference():
    from code2wav.sidecar.kernels import conv_gemm

    for case in CL_CASES:
        x, weight, bias, dilation, alpha, beta, log_params = _cl_inputs(case)
        y = torch.ops.code2wav.conv_snake_cl(x, weight, bias, dilation, alpha, beta, log_params, [16, 16, 16, 1, 1])
        assert torch.equal(y, conv_gemm.reference(x, weight, bias, dilation, alpha, beta, log_params).contiguous())


KEY = (4, 64, 454, torch.bfloat16, torch.device("cuda", 0), True, True)
GEO = geometry(torch.nn.Conv1d(64, 64, 7, dilation=3))


def test_the_choice_cache_round_trips_and_keeps_gpus_versions_and_convs_apart(tmp_path):
    cache = ChoiceCache(tmp_path, IDENTITY)
    assert cache.lookup("decoder.0", GEO, KEY) is None
    cache.store("decoder.0", GEO, KEY, "gemm_cl2", {"cudnn": 0.4, "gemm_cl2": 0.25})
    again = ChoiceCache(tmp_path, IDENTITY)
    assert again.lookup("decoder.0", GEO, KEY) == ("gemm_cl2", {"cudnn": 0.4, "gemm_cl2": 0.25})
    assert again.lookup("decoder.1", GEO, KEY) is None
    assert again.lookup("decoder.0", GEO, (*KEY[:2], 455, *KEY[3:])) is None
    other_conv = geometry(torch.nn.Conv1d(64, 32, 3, dilation=2))  # another conv at the same path: not its choice
    assert again.lookup("decoder.0", other_conv, KEY) is None
    other = ChoiceCache(tmp_path, {**IDENTITY, "gpu": "another GPU"})
    assert other.path != cache.path and other.lookup("decoder.0", GEO, KEY) is None
    data = json.loads(cache.path.read_text())  # JSON, the identity in plain words
    assert data["identity"] == IDENTITY and oct(cache.path.stat().st_mode & 0o777) == "0o644"
    assert shape_key("decoder.0", GEO, KEY) == "decoder.0|64x64k7d3g1b1|4x64x454|bfloat16|act1|k1"


def test_two_processes_writing_one_cache_keep_each_others_choices(tmp_path):
    first, second = ChoiceCache(tmp_path, IDENTITY), ChoiceCache(tmp_path, IDENTITY)  # both read an empty file
    first.store("decoder.0", GEO, KEY, "cudnn", {"cudnn": 0.4})
    second.store("decoder.1", GEO, KEY, "im2col", {"im2col": 0.2})
    again = ChoiceCache(tmp_path, IDENTITY)
    assert again.lookup("decoder.0", GEO, KEY)[0] == "cudnn" and again.lookup("decoder.1", GEO, KEY)[0] == "im2col"


def test_an_unwritable_cache_folder_is_said_once(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    cache = ChoiceCache(tmp_path / "file" / "sub", IDENTITY)  # a folder under a file: never writable
    for i in range(3):
        cache.store("decoder.0", GEO, (*KEY[:2], 400 + i, *KEY[3:]), "cudnn", {"cudnn": 0.4})
    assert caplog.text.count("not written") == 1 and not cache.writable
    assert cache.lookup("decoder.0", GEO, (*KEY[:2], 402, *KEY[3:]))[0] == "cudnn"  # still kept in memory


def test_a_damaged_or_foreign_cache_file_is_measured_again_not_trusted(tmp_path, caplog):
    cache = ChoiceCache(tmp_path, IDENTITY)
    cache.store("decoder.0", GEO, KEY, "cudnn", {"cudnn": 0.4})
    cache.path.write_text(cache.path.read_text()[:40])  # truncated
    assert ChoiceCache(tmp_path, IDENTITY).entries == {}
    cache.path.write_text(json.dumps({"identity": {**IDENTITY, "gpu": "forged"}, "entries": {
        shape_key("decoder.0", GEO, KEY): {"form": "gemm_cl0", "timings_ms": {}}}}))
    assert ChoiceCache(tmp_path, IDENTITY).entries == {}
    good = {"form": "cudnn", "timings_ms": {"cudnn": 0.4}}
    cache.path.write_text(json.dumps({"identity": IDENTITY, "entries": {  # entries of the wrong types are dropped
        "a": good, "b": {"form": "cudnn", "timings_ms": {"cudnn": None}}, "c": {"form": 3, "timings_ms": {}},
        "d": ["cudnn"]}}))
    assert ChoiceCache(tmp_path, IDENTITY).entries == {"a": good}
    assert "unreadable" in caplog.text and "not this GPU's" in caplog.text


def test_a_cached_choice_is_used_unmeasured_and_fallbacks_are_counted_and_exported(tmp_path):
    conv = torch.nn.Conv1d(8, 8, 7, dilation=3)
    x = torch.randn(2, 8, 40)
    choice, events = ConvChoice(), ChoiceEvents()
    choice.name, choice.events, choice.cache = "decoder.0", events, ChoiceCache(tmp_path, IDENTITY)
    key = choice.key(tuple(x.shape), x.dtype, x.device, False)
    choice.cache.store("decoder.0", geometry(conv), key, "polyphase", {"cudnn": 0.3, "polyphase": 0.2})
    with torch.inference_mode():
        assert choice.decide(key, x, conv, True, None, False) == "polyphase"  # no CUDA needed: nothing timed
        assert choice.decisions[key] == "polyphase" and choice.timings_ms[key]["polyphase"] == 0.2
        choice.cache = None
        for i in range(MAX_MEASURED_SHAPES):  # past the cap: cuDNN, unmeasured, counted
            choice.decisions[("filler", i)] = "cudnn"
        past = choice.key((2, 8, 41), x.dtype, x.device, False)
        assert choice.decide(past, x, conv, True, None, False) == "cudnn"
        assert choice.decisions[past] == "cudnn"  # remembered: the next step of that shape is not counted again
    assert events.snapshot() == ({("polyphase", "cache"): 1}, {"past_shape_cap": 1})
    registry = CollectorRegistry()
    registry.register(KernelChoiceCollector(events))
    text = generate_latest(registry).decode()
    assert 'code2wav_sidecar_kernel_fallbacks_total{reason="past_shape_cap"} 1.0' in text
    assert 'code2wav_sidecar_kernel_fallbacks_total{reason="in_capture"} 0.0' in text  # known reasons from the start
    assert 'code2wav_sidecar_conv_choices{form="polyphase",source="cache"} 1.0' in text


LAYER_SHAPES = [  # (batch, C_in, C_out, kernel size, dilation, new frames' columns): the decoders' own dense convs
    (1, 768, 768, 7, 1, 8), (3, 384, 384, 7, 3, 4 * 40), (64, 96, 96, 7, 9, 25 * 40), (1, 1024, 1536, 7, 1, 1),
    (64, 192, 192, 7, 1, 25 * 20), (3, 1024, 1536, 7, 1, 4),
]


@pytest.mark.cuda
@pytest.mark.parametrize("batch, c_in, c_out, ksize, dilation, num_cols", LAYER_SHAPES)
def test_every_form_equals_the_float32_conv_at_the_layer_shapes(no_tf32, batch, c_in, c_out, ksize, dilation,
                                                               num_cols):
    gen = torch.Generator(device="cuda").manual_seed(num_cols)
    conv = torch.nn.Conv1d(c_in, c_out, ksize, dilation=dilation).cuda()
    x = torch.randn(batch, c_in, num_cols + (ksize - 1) * dilation, device="cuda", generator=gen)
    alpha, beta = (torch.randn(2, c_out, device="cuda", generator=gen) * 0.3).unbind(0)
    ref = conv(x)  # [B, C_out, T] float32
    ref_act = snake_math.activate(ref, alpha, beta, True)
    layer = torch.nn.Conv1d(c_in, c_out, ksize, dilation=dilation).cuda().to(torch.bfloat16)
    layer.load_state_dict(conv.state_dict())
    choice = ConvChoice()
    choice.kernels = True
    xb = x.to(torch.bfloat16)
    with torch.inference_mode():
        forms = choice.offered(xb, layer)
        assert {"gemm_cl0", "im2col"} <= set(forms) or batch == 64  # im2col past its copy budget at batch 64
        for form in forms:
            layouts = [xb] + ([xb.transpose(1, 2).contiguous().transpose(1, 2)]
                              if conv_forms.reads_channels_last(form) else [])
            for x_in in layouts:
                got = choice.run(form, x_in, layer, True, None)
                assert (got.float() - ref).abs().max().item() < 0.03 * ref.abs().max().item(), form
                got = choice.run(form, x_in, layer, True, (alpha.bfloat16(), beta.bfloat16(), True))
                assert (got.float() - ref_act).abs().max().item() < 0.03 * ref_act.abs().max().item(), form


@pytest.mark.cuda
def test_a_second_start_reads_the_measured_choices(tmp_path, no_tf32):
    from code2wav.sidecar.kernels.choice_cache import identity

    conv = torch.nn.Conv1d(192, 192, 7, dilation=3).cuda().to(torch.bfloat16)
    x = torch.randn(4, 192, 18 + 100, device="cuda", dtype=torch.bfloat16)
    outputs, chosen = [], []
    for start in range(2):
        choice, events = ConvChoice(), ChoiceEvents()
        choice.kernels, choice.name, choice.events = True, "decoder.1", events
        choice.cache = ChoiceCache(tmp_path, identity(x.device))
        with torch.inference_mode():
            outputs.append(choice(x, conv))
            key = choice.key(tuple(x.shape), x.dtype, x.device, False)  # kernels allowed: autograd off
        source = "measured" if start == 0 else "cache"
        assert events.snapshot()[0] == {(choice.decisions[key], source): 1}
        chosen.append((choice.decisions[key], choice.timings_ms[key]))
    assert chosen[1][0] == chosen[0][0] and chosen[1][1] == pytest.approx(chosen[0][1], abs=1e-6)  # read back
    assert torch.equal(outputs[0], outputs[1])  # the same form: the same kernels


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CUDA wheel of torch ships it)")
def test_the_tma_descriptors_read_a_misaligned_channels_last_view_from_a_fresh_copy():
    """A channels-last view one element into its storage counts as contiguous once transposed, so only a fresh copy
    gives the descriptors 16-byte aligned rows (``descriptors``); TMA's 32-bit row coordinates are checked."""
    from code2wav.sidecar.kernels import conv_gemm_tma

    flat = torch.randn(2 * 20 * 16 + 1, dtype=torch.bfloat16)
    x = flat[1:].view(2, 20, 16).transpose(1, 2)  # [B, C, L] channels-last, base 2 bytes off 16
    assert conv_gemm_tma.channels_last(x) and not conv_gemm_tma.tma_ok(x)
    weight = conv_gemm_tma.kernel_weight(torch.randn(16, 16, 7, dtype=torch.bfloat16))
    *_, read, _, rows_per_batch = conv_gemm_tma.descriptors(x, weight, conv_gemm_tma.TmaTile(16, 16, 16, 16, 1, 1))
    assert conv_gemm_tma.tma_ok(read) and torch.equal(read, x) and rows_per_batch == 20
    assert read.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
