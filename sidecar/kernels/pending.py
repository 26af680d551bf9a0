"""Pending biases: a fused decoder chain leaves per-channel biases out of the residual stream and adds their sum in
the next kernel that reads it.

Where a family's Snakes run fused (``folds_biases``), a conv whose output goes straight into a Snake kernel runs
without its bias (PyTorch adds a cuDNN conv's bias in a full pass of its own) and the kernel adds it (``in_bias``).
A residual unit ``x + b + W @ h`` goes further: it adds ``W @ h`` to the stored ``x`` in the GEMM's epilogue and
leaves ``b`` pending too, so no pass over the stream only adds a bias. The true activation is ``x +
sum(pending)``; ``run_chain`` threads the pending biases through a family's layers and ``BiasSum`` gives each
consumer their sum, computed once while the parameters are unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .derived import DerivedTensor


def folds_biases(act, x: Tensor) -> bool:
    """Whether a family's blocks around ``act`` (a Snake module with ``runs_fused``) take their fused, in-place form:
    conv biases moved into the next kernel (``in_bias``) or left pending (``run_chain``), a residual unit's skip
    path written over its input (``baddbmm(out=x)``). Where ``act`` runs fused (CUDA, not under ``torch.compile``)
    and autograd is off (in-place writes)."""
    return act.runs_fused(x) and not torch.is_grad_enabled()


def run_chain(layers, x: Tensor, lengths: Tensor, ctx, pending: tuple[Tensor, ...]
              ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """Run ``layers`` (a family's blocks or residual units) in order, threading the pending biases: each is called
    ``layer(x, lengths, ctx, pending)`` and returns ``(x, lengths, pending)``. ``pending`` are per-channel biases
    ``[C]`` that belong to ``x`` but were not added to it (``folds_biases``): the true activation is ``x +
    sum(pending)``. A layer that reads ``x`` adds their sum in its first kernel (``BiasSum``, as ``in_bias``); a
    residual unit whose skip path is ``x + b + W @ h`` adds ``W @ h`` to the stored ``x`` and passes ``(*pending,
    b)`` on, so no pass over the residual stream only adds a bias. ``()``: nothing pending. Returns the last
    layer's ``(x, lengths, pending)``."""
    for layer in layers:
        x, lengths, pending = layer(x, lengths, ctx, pending)
    return x, lengths, pending


def float_sum(parts: tuple[Tensor, ...]) -> Tensor:
    """``sum(parts)`` ``[C]`` in float32 (detached: derived from parameters, as ``DerivedTensor`` values are)."""
    return torch.stack([p.detach().float() for p in parts]).sum(0)


class BiasSum:
    """The sum of a chain's pending biases, in their dtype (float32 sum, one rounding), kept between steps as a
    ``DerivedTensor`` (made again when a part changed; not kept when made inside a capture): after the first step
    a step adds no kernel for it. One per consumer (a module attribute), so each sees one set of parts."""

    def __init__(self) -> None:
        self._sum: DerivedTensor[Tensor] = DerivedTensor()

    def __call__(self, parts: tuple[Tensor, ...]) -> Tensor | None:
        """``sum(parts)`` ``[C]``; the part itself for one part, None for none."""
        if len(parts) <= 1:
            return parts[0] if parts else None
        return self._sum.get(parts, lambda: float_sum(parts).to(parts[0].dtype))
