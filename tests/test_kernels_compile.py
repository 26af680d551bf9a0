"""Every Triton kernel of ``sidecar/kernels/`` compiles for the H200 (sm_90), on a machine without a GPU.

Triton's interpreter (``test_kernels.py``, ``test_conv_choice.py``) runs a kernel's Python on CPU tensors: it checks
the indexing and the math, but not what only the compiler rejects (a variable redefined with another type inside an
``if``, a ``tl.dot`` on tiles smaller than 16, an unsupported dtype in a constexpr branch). Here each kernel is
compiled ahead of time (``triton.compile`` with a ``GPUTarget("cuda", 90, 32)``: Triton's own LLVM and ``ptxas``,
no driver) in every constexpr variant the ops launch, with the dtypes the server runs (bf16 and fp32 activations),
and must give a cubin. The GPU machine's Triton may be another version, so this is a gate, not a proof.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the CUDA wheel of torch ships it)")

POINTER_TYPES = {"lengths_ptr": "*i64", "sums_ptr": "*fp32", "start_ptr": "*i64", "index_ptr": "*i64",
                 "inv_freq_ptr": "*fp32", "mask_ptr": "*i1"}
"""Pointer arguments that are not of the activation dtype."""


def _compile(kernel, dtype: str, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer_types = dict(POINTER_TYPES)
    if constexprs.get("HAS_STATE") is False:  # the Snake launchers pass x as lengths without a state (never read)
        pointer_types["lengths_ptr"] = f"*{dtype}"
    signature = {}
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name] = pointer_types.get(param.name, f"*{dtype}")
        else:
            signature[param.name] = "i32"
    missing = {p.name for p in kernel.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"constexprs not given: {missing}"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _variants():
    import triton

    from code2wav.sidecar.kernels import (conv_gemm, conv_gemm_cl, depthwise, layer_glue, matmul, rope_cache, snake,
                                          snake_conv,
                                          snake_kernels, snake_math, state_cat, window_inputs)

    for dtype in ("bf16", "fp32"):
        sine = 2 if dtype == "bf16" else snake_math.SINE  # snake_math.sine_for: sin.approx for 16-bit CUDA tensors
        for has_state, in_bias in ((True, False), (False, True), (True, True), (False, False)):
            for log_params in (True, False):
                yield (f"snake_cat-{dtype}-state{has_state:d}-in{in_bias:d}-log{log_params:d}",
                       snake_kernels._snake_cat_kernel, dtype,
                       dict(LOG_PARAMS=log_params, HAS_STATE=has_state, HAS_IN_BIAS=in_bias,
                            SINE=sine, BLOCK=snake.BLOCK_COLS), {})
            for pairs in (False, True):  # the tiled kernel: channels-last in or out, and transposed.py's pairs
                yield (f"snake_cat_tile-{dtype}-state{has_state:d}-in{in_bias:d}-pairs{pairs:d}",
                       snake_kernels._snake_cat_tile_kernel, dtype,
                       dict(LOG_PARAMS=True, HAS_STATE=has_state, HAS_IN_BIAS=in_bias, SINE=sine, PAIRS=pairs,
                            BLOCK_C=snake.tile_for(96)[0], BLOCK_T=snake.tile_for(96)[1],
                            BLOCK_P=snake.state_cols_for(1 if pairs else 54)),  # pairs: a one-frame state
                       {})
        for in_bias in (True, False):
            yield (f"snake_conv_out-taps-{dtype}-in{in_bias:d}", snake_conv._tap_sums_kernel, dtype,
                   dict(HAS_IN_BIAS=in_bias, LOG_PARAMS=True, SINE=sine, IEEE=dtype == "fp32", KSIZE=7, BLOCK_K=16,
                        BLOCK_C=snake_conv.BLOCK_CHANNELS, BLOCK_T=snake_conv.BLOCK_SAMPLES, BLOCK_P=8), {})
        yield (f"snake_conv_out-sum-{dtype}", snake_conv._shifted_sum_kernel, dtype,
               dict(KSIZE=7, BLOCK_T=snake_conv.BLOCK_SAMPLES), {})
        for activate in (True, False):
            yield (f"depthwise-{dtype}-act{activate:d}", depthwise._depthwise_kernel, dtype,
                   dict(KSIZE=7, DILATION=9, ACTIVATE=activate, LOG_PARAMS=False, SINE=sine,
                        BLOCK=depthwise.BLOCK_COLS), {})
            for block_c in (depthwise.BLOCK_CL[1], 4):  # a wide layer's tile, and the narrowest tile a layer gets
                yield (f"depthwise_cl-{dtype}-act{activate:d}-c{block_c}", depthwise._depthwise_cl_kernel, dtype,
                       dict(KSIZE=7, DILATION=9, ACTIVATE=activate, LOG_PARAMS=False, SINE=sine,
                            BLOCK_T=depthwise.BLOCK_CL[0], BLOCK_C=block_c), {})
        for heads, dim in ((16, 64), (3, 6)):  # the shipped transformer's heads, and neither a power of two
            yield (f"rope_kv_cache-{dtype}-h{heads}-d{dim}", rope_cache._rope_kv_cache_kernel, dtype,
                   dict(DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim)), {})
        for half in (32, 3):  # the shipped head size's half, and one that is not a power of two
            yield (f"window_inputs-{dtype}-half{half}", window_inputs._window_inputs_kernel, dtype,
                   dict(HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_K=window_inputs.BLOCK_COLS), {})
        for cols in (512, 37):  # the shipped hidden size, and one that is not a power of two
            yield (f"add_rms_norm-{dtype}-c{cols}", layer_glue._add_rms_norm_kernel, dtype,
                   dict(EPS=1e-5, BLOCK=triton.next_power_of_2(cols)), {})
        for cols in (1024, 7):  # the shipped intermediate size (one full block), and a small odd one
            yield (f"silu_mul-{dtype}-c{cols}", layer_glue._silu_mul_kernel, dtype,
                   dict(BLOCK=min(layer_glue.MAX_GATE_BLOCK, triton.next_power_of_2(cols))), {})
        yield (f"state_cat-{dtype}", state_cat._state_cat_kernel, dtype,
               dict(BLOCK_C=state_cat.BLOCK_CHANNELS, BLOCK_T=state_cat.BLOCK_COLS), {})
    for i, config in enumerate(conv_gemm.CONFIGS):  # bf16 only: ConvChoice offers the GEMM kernel for bf16/fp16
        for has_bias, activate in ((True, True), (False, False), (True, False)):
            yield (f"conv_gemm-config{i}-bias{has_bias:d}-act{activate:d}", conv_gemm._conv_kernel, "bf16",
                   dict(HAS_BIAS=has_bias, ACTIVATE=activate, LOG_PARAMS=True, SINE=2, IEEE=False,
                        BLOCK_CO=config.block_co,
                        BLOCK_T=config.block_t, BLOCK_CI=config.block_ci),
                   dict(num_warps=config.num_warps, num_stages=config.num_stages))
    for i, config in enumerate(conv_gemm_cl.CONFIGS):  # bf16 only, as conv_gemm's
        for has_bias, activate, even_ci in ((True, True, True), (False, False, False), (True, False, True)):
            yield (f"conv_gemm_cl-config{i}-bias{has_bias:d}-act{activate:d}-even{even_ci:d}",
                   conv_gemm_cl._conv_cl_kernel, "bf16",
                   dict(HAS_BIAS=has_bias, ACTIVATE=activate, LOG_PARAMS=True, SINE=2, EVEN_CI=even_ci,
                        BLOCK_T=config.block_t, BLOCK_CO=config.block_co, BLOCK_CI=config.block_ci),
                   dict(num_warps=config.num_warps, num_stages=config.num_stages))
    for i, config in enumerate(matmul.CONFIGS):  # fp32 only: the 3xTF32 GEMM is offered for float32
        for has_bias, accumulate, even_k in ((True, False, True), (False, True, True), (False, False, False)):
            yield (f"mm_3xtf32-config{i}-bias{has_bias:d}-acc{accumulate:d}-even{even_k:d}", matmul._mm_kernel,
                   "fp32", dict(HAS_BIAS=has_bias, ACCUMULATE=accumulate, EVEN_K=even_k, GROUP=matmul.GROUP_M,
                                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k),
                   dict(num_warps=config.num_warps, num_stages=config.num_stages))


VARIANTS = list(_variants()) if importlib.util.find_spec("triton") else []


@pytest.mark.parametrize("name, kernel, dtype, constexprs, launch", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_the_kernel_compiles_for_sm90(name, kernel, dtype, constexprs, launch):
    compiled = _compile(kernel, dtype, constexprs, **launch)
    assert len(compiled.asm["cubin"]) > 0
    assert ".target sm_90" in compiled.asm["ptx"]


ALIGNED_INTS = ("c_in", "c_out", "stride_xb", "stride_xt", "stride_wo", "stride_wk")
"""The channels-last kernel's integer arguments a launch at the decoders' shapes passes as multiples of 16 (Triton
specializes such arguments; every channel count of both families is one)."""


@pytest.mark.parametrize("index", range(3))
def test_the_channels_last_conv_kernel_pipelines_its_loads_into_wgmma(index):
    """What the channels-last form is for: at aligned shapes its sm_90 code issues asynchronous 16-byte copies
    (``cp.async``, pipelined over ``num_stages``) feeding Hopper's ``wgmma``, where ``conv_gemm``'s column-shifted
    loads are synchronous."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from code2wav.sidecar.kernels import conv_gemm_cl

    kernel, config = conv_gemm_cl._conv_cl_kernel, conv_gemm_cl.CONFIGS[index]
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name], attrs[(i,)] = "*bf16", [["tt.divisibility", 16]]
        else:
            signature[param.name] = "i32"
            if param.name in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = dict(HAS_BIAS=True, ACTIVATE=True, LOG_PARAMS=True, SINE=2, EVEN_CI=True, BLOCK_T=config.block_t,
                      BLOCK_CO=config.block_co, BLOCK_CI=config.block_ci)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx


TMA_ALIGNED_INTS = ("c_in", "c_out", "num_cols_out", "rows_per_batch", "c", "num_cols", "stride_xb", "stride_xc")
"""The TMA kernels' integer arguments a batch-16/64 launch at the decoders' shapes passes as multiples of 16."""


def _compile_tma(kernel, config, descriptors: dict[str, int], constexprs: dict):
    """``kernel`` compiled for sm_90 in tile ``config`` (a ``TmaTile``), bf16: each named descriptor argument a
    ``[rows, block_ci]`` tile (``descriptors``: name -> rows), pointers and ``TMA_ALIGNED_INTS`` 16-divisible, as a
    launch at the decoders' shapes specializes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name in descriptors:
            signature[param.name] = f"tensordesc<bf16[{descriptors[param.name]}, {config.block_ci}]>"
        elif param.name.endswith("_ptr"):
            signature[param.name], attrs[(i,)] = "*bf16", [["tt.divisibility", 16]]
        else:
            signature[param.name] = "i32"
            if param.name in TMA_ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = dict(constexprs, LOG_PARAMS=True, SINE=2, BLOCK_T=config.block_t, BLOCK_CO=config.block_co,
                      BLOCK_CO2=config.block_co2, BLOCK_CI=config.block_ci)
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


@pytest.mark.parametrize("index", range(4))
def test_the_tma_conv_kernel_loads_by_tma_into_wgmma_without_spilling(index):
    """``conv_gemm_tma``'s tiles come in by the tensor memory accelerator (``cp.async.bulk.tensor``) and feed
    ``wgmma``, in every tile shape offered, with no register spills (with the second accumulator and the Snake
    epilogue: its heaviest variant)."""
    from code2wav.sidecar.kernels import conv_gemm_tma

    assert len(conv_gemm_tma.CONFIGS) == 4
    config = conv_gemm_tma.CONFIGS[index]
    compiled = _compile_tma(conv_gemm_tma._conv_tma_kernel, config,
                            {"x_desc": config.block_t, "w_desc": config.block_co,
                             "w2_desc": config.block_co2 or config.block_co}, dict(HAS_BIAS=True, ACTIVATE=True))
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert _registers(compiled)[1] == 0, config


@pytest.mark.parametrize("index", range(2))
def test_the_unit_kernel_loads_by_tma_and_runs_both_gemms_on_wgmma_without_spilling(index):
    """``unit_tma``'s kernel: conv1's tiles by TMA into ``wgmma``, the 1x1 conv of its epilogue on ``wgmma`` too (at
    least two more of them), in each tile shape offered. Spills are not asserted here: none with Triton 3.6 (the GPU
    machine's, where these tiles were measured), 36-48 bytes a thread with Triton 3.9 (CI's)."""
    from code2wav.sidecar.kernels import unit_tma

    assert len(unit_tma.CONFIGS) == 2
    config = unit_tma.CONFIGS[index]
    compiled = _compile_tma(unit_tma._unit_tail_kernel, config,
                            {"a_desc": config.block_t, "w_desc": config.block_co, "w2_desc": config.block_co2}, {})
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and ptx.count("wgmma.mma_async") >= 4, config


def _registers(compiled) -> tuple[int, int]:
    """``(registers per thread, spill-store bytes)`` that ``ptxas -v`` reports for a compiled kernel's PTX (Triton's
    own ``ptxas``)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia import compiler as nvidia

    try:
        ptxas = nvidia.get_ptxas(90).path
    except TypeError:  # Triton before 3.5 took no architecture
        ptxas = nvidia.get_ptxas().path
    target = re.search(r"\.target (sm_\w+)", compiled.asm["ptx"]).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([ptxas, "-v", "--gpu-name", target, ptx.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    return (int(re.search(r"Used (\d+) registers", report).group(1)),
            int(re.search(r"(\d+) bytes spill stores", report).group(1)))


def _blocks_per_sm(registers: int, num_warps: int = 4) -> int:
    """Blocks of ``num_warps`` warps an sm_90 SM holds at ``registers`` per thread (64K registers per SM, allocated
    per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    return 65536 // (per_warp * num_warps)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("log_params", [True, False])
@pytest.mark.parametrize("pairs, num_state_cols", [(False, 54), (True, 1)])  # a dilation-9 unit; the frame pairs
def test_the_state_program_does_not_lower_the_tiled_kernels_occupancy(dtype, log_params, pairs, num_state_cols):
    """A kernel's registers are the most any of its branches needs, for every program. The tiled Snake kernel's state
    program (one program per row and channel block) once took the whole state in one ``[64, next_pow2(P)]`` piece:
    at ``P = 54`` (a dilation-9 unit) Triton 3.9's ptxas gave the bf16 kernel 254 registers with spills, against
    146 without a state, and on the H200 every tile of those calls ran at half the speed of the same call at ``P =
    6`` (docs/performance.md). In pieces of ``STATE_COLS`` columns (``BLOCK_P`` as the launcher takes it) the kernel
    keeps the blocks per SM of its state-less build and spills no more than a word or so (a whole state in one
    piece spilled kilobytes). Register counts move by a few between ptxas versions, so the test compares
    occupancy, not counts."""
    from code2wav.sidecar.kernels import snake, snake_kernels

    block_c, block_t = snake.tile_for(96)
    common = dict(LOG_PARAMS=log_params, HAS_IN_BIAS=True, SINE=2 if dtype == "bf16" else 1, PAIRS=pairs,
                  BLOCK_C=block_c, BLOCK_T=block_t, BLOCK_P=snake.state_cols_for(num_state_cols))
    with_state = _registers(_compile(snake_kernels._snake_cat_tile_kernel, dtype, dict(common, HAS_STATE=True)))
    without = _registers(_compile(snake_kernels._snake_cat_tile_kernel, dtype, dict(common, HAS_STATE=False)))
    assert with_state[1] <= without[1] + 16, f"the state program spills: {with_state} against {without}"
    assert _blocks_per_sm(with_state[0]) >= _blocks_per_sm(without[0]), (with_state, without)
