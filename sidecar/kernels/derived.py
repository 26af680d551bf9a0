"""A tensor derived from parameters (a kernel's weight layout, several weights stacked), kept between calls.

Rules:
- Made on first use and made again when a source parameter changed: moved, cast, or written through the parameter
  (as ``load_state_dict`` does). Weights are fixed after load; a write through ``.data`` is not seen.
- Inside a CUDA graph capture a stale value is made for that call only, not kept: a capture records kernels
  without running them, so a tensor made there holds nothing until the graph replays. Warm-up makes it before
  capture.
- A replaced CUDA value is kept, not freed: a graph captured with it still reads its memory (such a graph keeps
  the weights it was captured with; capture again after changing weights).
"""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def kernel_forms() -> bool:
    """Whether a block may take its inference form (derived weights, ``code2wav::*`` ops, in-place outputs): autograd
    off (derived weights are detached copies and the ops have no backward) and ``torch.compile`` not tracing
    (Inductor fuses the plain form itself, and data-pointer checks cannot be traced)."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _identity(t: Tensor) -> tuple:
    """What changes when a tensor is moved, cast or written in place."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor (no version counter; it cannot be written outside inference mode)
        version = -1
    return (t.data_ptr(), version, t.dtype, t.device)


def _on_cuda(value) -> bool:
    tensors = value if isinstance(value, tuple) else (value,)
    return any(isinstance(t, Tensor) and t.is_cuda for t in tensors)


class DerivedTensor(Generic[T]):
    """One derived value (a tensor or a tuple of tensors) and the identity of the sources it was made from."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: T | None = None
        self._replaced: list[T] = []  # values a captured graph may still read

    def get(self, sources: Sequence[Tensor], make: Callable[[], T]) -> T:
        """The value made by ``make()`` from ``sources``, made again only when one of them changed."""
        key = tuple(_identity(t) for t in sources)
        if key == self._key and self._value is not None:
            return self._value
        value = make()
        if _on_cuda(value) and torch.cuda.is_current_stream_capturing():
            return value  # for this capture only (see the module docstring)
        if self._value is not None and _on_cuda(self._value):
            self._replaced.append(self._value)
        self._key, self._value = key, value
        return value

    def clear(self) -> None:
        """Drop the value (no captured graph uses it)."""
        self._key, self._value = None, None
