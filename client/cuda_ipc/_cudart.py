"""The CUDA runtime calls of the client's regions now live in ``code2wav.cudart`` (shared with the sidecar, on
NVIDIA's cuda-bindings); this name stays for the probes that wrap ``Runtime`` methods (loadgen/probes)."""

from __future__ import annotations

from code2wav.cudart import Runtime, runtime

__all__ = ["Runtime", "runtime"]
