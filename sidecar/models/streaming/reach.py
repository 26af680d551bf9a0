"""A stream's history contract: how many recent input frames determine its decoder state (``history_frames``).

Every layer of both families is causal with a finite reach back, so the state after frame ``t`` (what the next
chunk reads: conv tails, transposed-conv frames, attention caches) is a function of frames ``t - H + 1 .. t`` only.
Replaying those ``H`` frames into a fresh stream rebuilds the state (up to float rounding), which is what a client
pool's failover and drain do (docs/client.md, "Failover and drain").

``H`` is found by one walk, from the output back to the input: start at the first output sample of the next frame
(index 0; earlier samples have negative indices, at each layer's own rate) and step back through the layers in
reverse order, keeping the oldest index the next output still reads. Each layer maps the oldest index ``m`` of its
output to the oldest of its input:

- ``CausalConv`` with ``c = (k - 1) * d`` state columns: ``m - c`` (same rate);
- ``CausalTransConv`` (kernel ``k``, stride ``s``; output sample ``p`` reads inputs ``ceil((p - k + 1) / s) ..
  floor(p / s)``): ``ceil((m - k + 1) / s)``, at the input's rate (``s`` times lower);
- a sliding-window attention layer whose cache holds ``w`` earlier positions: ``m - w``;
- pointwise layers (1x1 convs, activations, norms, linears, conditioning): ``m``.

At the input rate the walk ends at ``-H``. It is exact at sample level (no rounding up of fractional reaches), so
``H - 1`` frames miss an input the state reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["Reach", "conv", "trans_conv", "attention", "history_frames"]


@dataclass(frozen=True)
class Reach:
    """One layer's reach back: ``kind`` is ``conv`` (``back`` columns), ``trans_conv`` (``kernel``, ``stride``)
    or ``attention`` (``back`` cached positions)."""

    kind: str
    back: int = 0
    kernel: int = 1
    stride: int = 1

    def oldest_input(self, oldest_output: int) -> int:
        """The oldest input index read by output indices ``>= oldest_output``."""
        if self.kind == "trans_conv":
            return -((self.kernel - 1 - oldest_output) // self.stride)  # ceil((m - k + 1) / s)
        return oldest_output - self.back


def conv(kernel_size: int, dilation: int = 1) -> Reach:
    """A stride-1 causal conv: ``(k - 1) * d`` columns back."""
    return Reach("conv", back=(kernel_size - 1) * dilation)


def trans_conv(kernel_size: int, stride: int) -> Reach:
    """A causal transposed conv cut to ``T * s`` samples (the last ``k - s`` dropped)."""
    return Reach("trans_conv", kernel=kernel_size, stride=stride)


def attention(num_cached: int) -> Reach:
    """A sliding-window attention layer whose queries see ``num_cached`` earlier positions."""
    return Reach("attention", back=num_cached)


def history_frames(layers: Iterable[Reach]) -> int:
    """``H``: input frames the state after a frame depends on; ``layers`` in forward order (pointwise ones
    omitted). The walk starts at the output rate and ends at the input rate (``trans_conv`` strides divide it)."""
    oldest = 0
    for layer in reversed(list(layers)):
        oldest = layer.oldest_input(oldest)
    return -oldest
