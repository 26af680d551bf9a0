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

    from code2wav.sidecar.kernels import (conv_gemm, depthwise, layer_glue, matmul, rope_cache, snake, snake_conv,
                                          snake_math, state_cat, window_inputs)

    for dtype in ("bf16", "fp32"):
        sine = 2 if dtype == "bf16" else snake_math.SINE  # snake_math.sine_for: sin.approx for 16-bit CUDA tensors
        for has_state, add_bias, in_bias in ((True, False, False), (False, False, True), (True, True, True),
                                             (True, True, False), (False, False, False)):
            for log_params in (True, False):
                yield (f"snake_cat-{dtype}-state{has_state:d}-bias{add_bias:d}-in{in_bias:d}-log{log_params:d}",
                       snake._snake_cat_kernel, dtype,
                       dict(LOG_PARAMS=log_params, HAS_STATE=has_state, ADD_BIAS=add_bias, HAS_IN_BIAS=in_bias,
                            SINE=sine, BLOCK=snake.BLOCK_COLS), {})
            for pairs in (False, True):  # the tiled kernel: channels-last in or out, and transposed.py's pairs
                yield (f"snake_cat_tile-{dtype}-state{has_state:d}-bias{add_bias:d}-in{in_bias:d}-pairs{pairs:d}",
                       snake._snake_cat_tile_kernel, dtype,
                       dict(LOG_PARAMS=True, HAS_STATE=has_state, ADD_BIAS=add_bias, HAS_IN_BIAS=in_bias,
                            SINE=sine, PAIRS=pairs, STATE_PROGRAM=has_state and not add_bias,
                            BLOCK_C=snake.tile_for(96, add_bias)[0], BLOCK_T=snake.tile_for(96, add_bias)[1],
                            BLOCK_P=64),
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
