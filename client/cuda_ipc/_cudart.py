"""ctypes calls torch does not offer: ``cudaMalloc``/``cudaFree`` outside torch's caching allocator (so the
export works whatever ``PYTORCH_CUDA_ALLOC_CONF`` says, ``expandable_segments`` included) and
``cudaIpcGetMemHandle``. Bound to the ``libcudart`` torch itself loaded."""

from __future__ import annotations

import ctypes

__all__ = ["Runtime", "runtime"]


class _MemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _torch_cudart_path() -> str:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise OSError("torch has not loaded libcudart (is CUDA initialised?)")
    return sorted(paths)[0]


class Runtime:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_MemHandle), ctypes.c_void_p]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]

    def _call(self, status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what}: {self._lib.cudaGetErrorString(status).decode(errors='replace')}")

    def malloc(self, nbytes: int, device_index: int) -> int:
        self._call(self._lib.cudaSetDevice(device_index), "cudaSetDevice")
        pointer = ctypes.c_void_p()
        self._call(self._lib.cudaMalloc(ctypes.byref(pointer), nbytes), f"cudaMalloc({nbytes})")
        return int(pointer.value or 0)

    def free(self, pointer: int) -> None:
        self._call(self._lib.cudaFree(ctypes.c_void_p(pointer)), "cudaFree")

    def export(self, pointer: int) -> bytes:
        handle = _MemHandle()
        self._call(self._lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(pointer)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle))  # all 64 bytes, NULs included


def runtime() -> Runtime:
    """Raises ``OSError`` or ``RuntimeError`` with the reason when the runtime cannot be bound."""
    return Runtime(ctypes.CDLL(_torch_cudart_path()))
