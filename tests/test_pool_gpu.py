"""A pool on a GPU (issue 46's GPU part; skipped without CUDA): placement prefers the sidecar on the caller's GPU,
whose chunks then travel by CUDA IPC, and spills over to the others (inline bytes) only when it is full; two
sidecars on one GPU share the streams and both take CUDA IPC."""

from __future__ import annotations

import pytest
import torch

from code2wav.client import SidecarClient, SidecarPool
from conftest import start_sidecar

pytestmark = pytest.mark.cuda


def _gpu_codes(golden_cases, index: int) -> torch.Tensor:
    return golden_cases["codes"][index % 2, :, :10].to("cuda:0")  # [Q, 10] on the caller's GPU


def _inline_audio(address: str, codes: torch.Tensor) -> torch.Tensor:
    """The same chunk decoded alone on the same sidecar, inline bytes (host codes)."""
    with SidecarClient(address, timeout_s=60, cuda_ipc=False) as client:
        with client.open_stream("reference") as stream:
            return stream.decode(codes.cpu())


def test_the_callers_gpu_comes_first_by_cuda_ipc_then_the_others_inline(tmp_path, golden_cases):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "cpu").mkdir()
    on_gpu = start_sidecar(tmp_path / "gpu", "--device", "cuda", "--max-streams", "8")
    on_cpu = start_sidecar(tmp_path / "cpu", "--device", "cpu", "--max-streams", "64")  # no CUDA IPC there
    # the references first: once the pool's streams fill the GPU's sidecar (8 slots) it has no slot for them
    expected = [_inline_audio(on_gpu.address, _gpu_codes(golden_cases, number)) for number in range(2)]
    pool = SidecarPool([on_cpu.address, on_gpu.address], timeout_s=60, device=torch.device("cuda", 0))
    try:
        local = [pool.open_stream(f"g{number}") for number in range(8)]
        assert {pool.address_of(stream) for stream in local} == {on_gpu.address}  # first, though it is smaller
        for number, stream in enumerate(local):
            wav = stream.decode(_gpu_codes(golden_cases, number))  # one at a time: each chunk decoded alone
            assert wav.is_cuda
            torch.cuda.synchronize()
            torch.testing.assert_close(wav.cpu(), expected[number % 2], rtol=0,
                                       atol=1e-6)  # as tests/test_cuda_ipc.py holds IPC to inline
        stats = pool.ipc_stats
        assert stats["ipc_chunks"] == 8 and not [k for k in stats if k.startswith("inline_fallback")], stats
        spilled = pool.open_stream("spill")  # the GPU's sidecar is full: the other one takes it, inline
        assert pool.address_of(spilled) == on_cpu.address
        wav = spilled.decode(_gpu_codes(golden_cases, 0))
        assert wav.is_cuda and pool.ipc_stats["ipc_chunks"] == 8
        assert sum(v for k, v in pool.ipc_stats.items() if k.startswith("inline_fallback")) == 1
        torch.testing.assert_close(wav.cpu(), _inline_audio(on_cpu.address, _gpu_codes(golden_cases, 0)), rtol=0,
                                   atol=1e-6)
    finally:
        pool.close()
        on_gpu.stop()
        on_cpu.stop()


def test_two_sidecars_on_one_gpu_share_the_streams_by_cuda_ipc(tmp_path, golden_cases):
    running = []
    try:
        for index in range(2):
            (tmp_path / f"s{index}").mkdir()
            running.append(start_sidecar(tmp_path / f"s{index}", "--device", "cuda", "--max-streams", "32"))
        pool = SidecarPool([sidecar.address for sidecar in running], timeout_s=60, device=torch.device("cuda", 0))
        try:
            streams = [pool.open_stream(f"s{number}") for number in range(32)]
            homes = [pool.address_of(stream) for stream in streams]
            assert sorted(homes.count(sidecar.address) for sidecar in running) == [16, 16]
            audio = pool.decode_batch([(stream, _gpu_codes(golden_cases, n)) for n, stream in enumerate(streams)])
            torch.cuda.synchronize()
            full = golden_cases["full"][:, 0]  # [cases, 40 * U]: one decode of all frames
            for number, wav in enumerate(audio):
                assert wav.is_cuda
                torch.testing.assert_close(wav.cpu(), full[number % 2, :10 * 48], rtol=0, atol=1e-4)
            stats = pool.ipc_stats
            assert stats["ipc_chunks"] == 32 and not [k for k in stats if k.startswith("inline_fallback")], stats
        finally:
            pool.close()
    finally:
        for sidecar in running:
            sidecar.stop()
