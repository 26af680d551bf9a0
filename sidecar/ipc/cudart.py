"""ctypes access to the CUDA runtime functions torch does not expose: IPC memory handles and pointer attributes.

Uses the very ``libcudart`` torch loaded (found in ``/proc/self/maps``), so the current device and context are
the ones torch uses. Every call checks its status and raises ``CudaIpcError`` with the runtime's message.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["CudaIpcError", "Cudart", "load_cudart", "host_id"]

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class CudaIpcError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _PointerAttributes(ctypes.Structure):
    # cudaPointerAttributes (CUDA >= 11): type, device, devicePointer, hostPointer; padded for later additions
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("device_pointer", ctypes.c_void_p),
                ("host_pointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 16)]


def _loaded_cudart_path() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().split(" ")[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


class Cudart:
    def __init__(self, lib: ctypes.CDLL, driver: ctypes.CDLL) -> None:
        self._lib = lib
        self._driver = driver
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_PointerAttributes), ctypes.c_void_p]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            message = self._lib.cudaGetErrorString(status).decode(errors="replace")
            self._lib.cudaGetLastError()  # clear the sticky-free error state of this thread
            raise CudaIpcError(f"{what} failed: {message} (cudaError {status})")

    def open_mem_handle(self, handle: bytes, device_index: int) -> int:
        """Map another process's allocation into this one, on ``device_index``; returns the device pointer."""
        self._check(self._lib.cudaSetDevice(device_index), "cudaSetDevice")
        raw = _Handle()
        ctypes.memmove(ctypes.addressof(raw), handle, min(len(handle), ctypes.sizeof(raw)))  # NULs included
        pointer = ctypes.c_void_p()
        self._check(self._lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, _LAZY_PEER_ACCESS),
                    "cudaIpcOpenMemHandle")
        return int(pointer.value or 0)

    def close_mem_handle(self, pointer: int) -> None:
        self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer)), "cudaIpcCloseMemHandle")

    def allocation_nbytes(self, pointer: int) -> int:
        """Size of the allocation ``pointer`` starts (driver ``cuMemGetAddressRange``); the only trustworthy
        bound for a region whose size a client claims."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        status = self._driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
        if status != 0:
            raise CudaIpcError(f"cuMemGetAddressRange failed (CUresult {status})")
        return int(size.value) - (pointer - int(base.value))

    def pointer_device(self, pointer: int) -> int:
        """The ordinal of the device whose memory ``pointer`` is."""
        attrs = _PointerAttributes()
        self._check(self._lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(pointer)),
                    "cudaPointerGetAttributes")
        return int(attrs.device)


def load_cudart() -> Cudart:
    """The runtime torch uses (call after CUDA is initialised). Raises ``CudaIpcError`` if none is found."""
    path = _loaded_cudart_path()
    errors = []
    for name in ([path] if path else []) + list(_SONAMES):
        try:
            return Cudart(ctypes.CDLL(name), ctypes.CDLL("libcuda.so.1"))
        except OSError as exc:
            errors.append(str(exc))
    raise CudaIpcError("no CUDA runtime library (libcudart) could be loaded: " + "; ".join(errors))


def host_id() -> str | None:
    """The kernel's boot id: processes (and containers) on one host share it; CUDA IPC needs one host."""
    boot_id = Path("/proc/sys/kernel/random/boot_id")
    return boot_id.read_text().strip() if boot_id.exists() else None
