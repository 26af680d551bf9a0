"""``code2wav.cudart``: the one CUDA runtime binding both sides use (NVIDIA cuda-bindings). CPU checks of its
error paths; the GPU paths run in tests/test_cuda_ipc.py (``@pytest.mark.cuda``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from code2wav.cudart import CudaBindingsMissing, CudaIpcError


def test_without_cuda_bindings_the_error_says_what_to_install():
    code = ("import sys; sys.modules['cuda.bindings'] = None\n"
            "from code2wav.cudart import runtime, CudaBindingsMissing, CudaIpcError\n"
            "try:\n    runtime()\nexcept CudaBindingsMissing as exc:\n"
            "    assert isinstance(exc, ImportError) and isinstance(exc, CudaIpcError)\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'code2wav-sidecar[cuda]'" in out.stdout and "cuda-bindings" in out.stdout


def test_sidecar_and_client_use_the_same_binding():
    from code2wav.client.cuda_ipc import channel
    from code2wav.cudart import Runtime
    from code2wav.sidecar.ipc import cudart as sidecar_cudart

    assert channel.Runtime is Runtime and sidecar_cudart.Cudart is Runtime
    assert sidecar_cudart.CudaIpcError is CudaIpcError and issubclass(CudaBindingsMissing, CudaIpcError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a machine without a GPU")
def test_a_failing_call_raises_the_typed_error_with_the_runtimes_reason():
    pytest.importorskip("cuda.bindings.runtime", reason="cuda-bindings not installed")
    from code2wav.cudart import runtime

    with pytest.raises(CudaIpcError, match=r"cudaSetDevice failed: .+ \(cudaError \d+\)"):
        runtime().malloc(1024, 0)
