"""The sidecar's view of the CUDA runtime: ``code2wav.cudart`` (NVIDIA's cuda-bindings, shared with the client)
under the names the IPC code uses, plus the host id CUDA IPC needs."""

from __future__ import annotations

from pathlib import Path

from code2wav.cudart import CudaBindingsMissing, CudaIpcError, Runtime, runtime

__all__ = ["CudaIpcError", "CudaBindingsMissing", "Cudart", "load_cudart", "host_id"]

Cudart = Runtime


def load_cudart() -> Runtime:
    """The runtime torch uses (call after CUDA is initialised). Raises ``CudaIpcError`` (``CudaBindingsMissing``
    without cuda-bindings)."""
    return runtime()


def host_id() -> str | None:
    """The kernel's boot id: processes (and containers) on one host share it; CUDA IPC needs one host."""
    boot_id = Path("/proc/sys/kernel/random/boot_id")
    return boot_id.read_text().strip() if boot_id.exists() else None
