"""ctypes calls torch does not offer: ``cudaMalloc``/``cudaFree`` outside torch's caching allocator (so the
export works whatever ``PYTORCH_CUDA_ALLOC_CONF`` says, ``expandable_segments`` included) and
``cudaIpcGetMemHandle``; and ``cudaMemcpyAsync`` into such memory, which spares building a tensor view per
chunk. Bound to the ``libcudart`` torch itself loaded (same runtime, same contexts, same streams)."""

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


_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyKind


class Runtime:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_MemHandle), ctypes.c_void_p]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]

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

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Device-to-device copy queued on the raw CUDA ``stream`` (``torch.cuda.Stream.cuda_stream``)."""
        self._call(self._lib.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEVICE_TO_DEVICE, stream), "cudaMemcpyAsync")

    def export(self, pointer: int) -> bytes:
        handle = _MemHandle()
        self._call(self._lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(pointer)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle))  # all 64 bytes, NULs included


def runtime() -> Runtime:
    """Raises ``OSError`` or ``RuntimeError`` with the reason when the runtime cannot be bound."""
    return Runtime(ctypes.CDLL(_torch_cudart_path()))
