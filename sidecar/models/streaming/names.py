"""The kit convs' parameter names against checkpoints that store a conv's weight and bias one level up.

A kit conv holds its weights in a torch conv module named ``conv`` (``<block>.conv.weight``). A family whose
checkpoint names them ``<block>.weight`` (VoxCPM2's, after weight-norm folding) maps names with ``flat_conv_names``
both ways; the files on disk keep their names.
"""

from __future__ import annotations

from torch import nn

from .conv import CausalConv
from .trans_conv import CausalTransConv


def flat_conv_names(root: nn.Module) -> dict[str, str]:
    """``{module name: checkpoint name}`` for every parameter of a kit conv under ``root``: ``a.conv.weight`` ->
    ``a.weight`` (the names of ``root.state_dict()`` that differ; every other name is the same in both)."""
    names: dict[str, str] = {}
    for prefix, module in root.named_modules():
        if isinstance(module, (CausalConv, CausalTransConv)):
            head = prefix + "." if prefix else ""
            for leaf, _ in module.conv.named_parameters():
                names[f"{head}conv.{leaf}"] = head + leaf
    return names
