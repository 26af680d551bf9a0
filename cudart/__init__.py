"""The CUDA runtime calls torch does not expose, through NVIDIA's maintained binding ``cuda-bindings``
(``import cuda.bindings.runtime``; install with ``pip install 'code2wav-sidecar[cuda]'``). One module for both
sides of CUDA IPC: the client allocates device memory outside torch's caching allocator (so the export works
whatever ``PYTORCH_CUDA_ALLOC_CONF`` says), exports it and copies into it; the sidecar opens the handle, checks
which device and how many bytes the pointer really has, and closes it.

The device-armed hand-off uses two driver calls on the same streams: the client's stream writes a doorbell word
after its codes (``write_value32``), the sidecar's stream waits for it (``wait_value32``). The words are shared host
memory (``cudart.doorbell_words``), which both processes register for the GPU (``host_register``).

The binding talks to the same CUDA runtime and driver as torch in this process (same contexts, same streams).
Every call checks its status and raises ``CudaIpcError`` with the runtime's message; without the binding,
``runtime()`` raises ``CudaBindingsMissing`` (both an ``ImportError`` and a ``CudaIpcError``) saying what to
install. Nothing here imports torch, and importing this module never needs a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["CudaIpcError", "CudaBindingsMissing", "Runtime", "runtime", "IPC_HANDLE_NBYTES"]

IPC_HANDLE_NBYTES = 64  # cudaIpcMemHandle_t
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: registered for every context, not just the current one
HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped: mapped into the device's address space


class CudaIpcError(RuntimeError):
    """A CUDA runtime or driver call failed; the message names the call and the runtime's reason."""


class CudaBindingsMissing(CudaIpcError, ImportError):
    """``cuda-bindings`` is not installed (CUDA IPC is then off; inline tensors still work)."""


def _bindings() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime as rt  # noqa: PLC0415 (optional dependency, imported on use)
    except ImportError as exc:
        raise CudaBindingsMissing(
            f"CUDA IPC needs NVIDIA's cuda-bindings (>=12), which cannot be imported ({exc}); install it with "
            "pip install 'code2wav-sidecar[cuda]' or pip install 'cuda-bindings>=12' matching your CUDA driver"
        ) from None
    return rt, driver


class Runtime:
    def __init__(self) -> None:
        self._rt, self._driver = _bindings()

    def _check(self, result: Any, what: str) -> Any:
        """``result`` is the binding's tuple ``(status, *values)``: the values, or ``CudaIpcError``."""
        status, *values = result if isinstance(result, tuple) else (result,)
        if int(status) != 0:
            _, message = self._rt.cudaGetErrorString(status)
            self._rt.cudaGetLastError()  # clear this thread's (non-sticky) error state
            text = message.decode(errors="replace") if isinstance(message, bytes) else str(message)
            raise CudaIpcError(f"{what} failed: {text} (cudaError {int(status)})")
        return values[0] if len(values) == 1 else values

    # ------------------------------------------------------------------ client: export and fill
    def malloc(self, nbytes: int, device_index: int) -> int:
        """``cudaMalloc`` on ``device_index`` (outside torch's caching allocator); returns the device pointer."""
        self._check(self._rt.cudaSetDevice(device_index), "cudaSetDevice")
        return int(self._check(self._rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))

    def free(self, pointer: int) -> None:
        self._check(self._rt.cudaFree(pointer), "cudaFree")

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Device-to-device copy queued on the raw CUDA ``stream`` (``torch.cuda.Stream.cuda_stream``)."""
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._check(self._rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")

    def write_value32(self, pointer: int, value: int, stream: int) -> None:
        """Driver ``cuStreamWriteValue32``: once the work queued on ``stream`` before it is done, the 32-bit word at
        ``pointer`` becomes ``value`` (with a memory barrier: that work's writes are visible first). The stream's
        device must be current on this thread (``torch.cuda.device``)."""
        self._check_driver(self._driver.cuStreamWriteValue32(
            self._driver.CUstream(stream), self._driver.CUdeviceptr(pointer), value, 0), "cuStreamWriteValue32")

    def wait_value32(self, pointer: int, value: int, stream: int) -> None:
        """Driver ``cuStreamWaitValue32``: work queued on ``stream`` after this waits until the 32-bit word at
        ``pointer`` reaches ``value`` (cyclic ``>=``: ``(int32)(word - value) >= 0``). The stream's device must be
        current on this thread."""
        self._check_driver(self._driver.cuStreamWaitValue32(
            self._driver.CUstream(stream), self._driver.CUdeviceptr(pointer), value, 0), "cuStreamWaitValue32")

    def host_register(self, pointer: int, nbytes: int) -> int:
        """``cudaHostRegister`` (mapped, portable) of ``nbytes`` of this process's host memory at ``pointer`` (page
        aligned); returns the device pointer the GPU reaches it by (``cudaHostGetDevicePointer``): the doorbell words
        of the device-armed hand-off, which one process's stream writes and another's waits on."""
        flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
        self._check(self._rt.cudaHostRegister(pointer, nbytes, flags), f"cudaHostRegister({nbytes})")
        try:
            return int(self._check(self._rt.cudaHostGetDevicePointer(pointer, 0), "cudaHostGetDevicePointer"))
        except CudaIpcError:
            self._rt.cudaHostUnregister(pointer)
            raise

    def host_unregister(self, pointer: int) -> None:
        self._check(self._rt.cudaHostUnregister(pointer), "cudaHostUnregister")

    def _check_driver(self, result: Any, what: str) -> None:
        """A driver call's ``(CUresult,)``: ``CudaIpcError`` with the driver's name and message unless it is 0."""
        status = result[0] if isinstance(result, tuple) else result
        if int(status) != 0:
            _, name = self._driver.cuGetErrorName(status)
            _, message = self._driver.cuGetErrorString(status)
            text = " ".join(x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in (name, message))
            raise CudaIpcError(f"{what} failed: {text} (CUresult {int(status)})")

    def export(self, pointer: int) -> bytes:
        """``cudaIpcGetMemHandle``: the 64 handle bytes, NULs included."""
        handle = self._check(self._rt.cudaIpcGetMemHandle(pointer), "cudaIpcGetMemHandle")
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_NBYTES)

    # ------------------------------------------------------------------ sidecar: open, check, close
    def open_mem_handle(self, handle: bytes, device_index: int) -> int:
        """Map another process's allocation into this one, on ``device_index``; returns the device pointer."""
        self._check(self._rt.cudaSetDevice(device_index), "cudaSetDevice")
        raw = self._rt.cudaIpcMemHandle_t()
        data = bytes(handle[:IPC_HANDLE_NBYTES]).ljust(IPC_HANDLE_NBYTES, b"\0")
        ctypes.memmove(raw.getPtr(), data, IPC_HANDLE_NBYTES)
        flags = self._rt.cudaIpcMemLazyEnablePeerAccess
        return int(self._check(self._rt.cudaIpcOpenMemHandle(raw, flags), "cudaIpcOpenMemHandle"))

    def close_mem_handle(self, pointer: int) -> None:
        self._check(self._rt.cudaIpcCloseMemHandle(pointer), "cudaIpcCloseMemHandle")

    def allocation_nbytes(self, pointer: int) -> int:
        """Bytes from ``pointer`` to the end of its allocation (driver ``cuMemGetAddressRange``): the only
        trustworthy bound for a region whose size a client claims."""
        status, base, size = self._driver.cuMemGetAddressRange(self._driver.CUdeviceptr(pointer))
        if int(status) != 0:
            raise CudaIpcError(f"cuMemGetAddressRange failed (CUresult {int(status)})")
        return int(size) - (pointer - int(base))

    def pointer_device(self, pointer: int) -> int:
        """The ordinal of the device whose memory ``pointer`` is (``cudaPointerGetAttributes``)."""
        attrs = self._check(self._rt.cudaPointerGetAttributes(pointer), "cudaPointerGetAttributes")
        return int(attrs.device)


def runtime() -> Runtime:
    """The binding (call after torch initialised CUDA). Raises ``CudaBindingsMissing`` without cuda-bindings."""
    return Runtime()
