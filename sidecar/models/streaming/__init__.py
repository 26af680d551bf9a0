"""The streaming kit: the stateful causal-conv building blocks and the state-layout contract, once for every family.

A family builds its decoder from these blocks and keeps only what is its own (activations, transformer layers,
residual units and decoder blocks composed of kit convs, conditioning layers, loaders, configs):

- ``StreamContext``: one batched call's state in and out, and per-row conditions;
- ``StatefulBlock``, ``assign_state_keys`` (the one walk that names each block's state entry and returns the state
  layout a family's ``Contract.state`` is built from), ``zero_state``;
- ``CausalConv``, ``CausalTransConv``: the causal convs, with their fused kernel paths (``sidecar/kernels/``);
- ``StreamActivation``: what a conv needs from the activation it applies before or after itself;
- ``StreamSequential``: blocks in order, threading ``(x, lengths)``;
- ``flat_conv_names``: the kit convs' parameter names against a checkpoint that stores them one level up;
- ``reach``: the history contract, ``history_frames`` (input frames that determine a stream's state).

Every block's ``forward(x, lengths, ctx)`` takes ``x`` ``[B, C, T]`` and the per-row valid lengths ``[B]`` and
returns ``(y, lengths_out)``; ``base.py`` states the state rules.
"""

from .activation import StreamActivation, activated_join
from .base import StatefulBlock, StreamContext, StreamSequential, assign_state_keys, zero_state
from .conv import CausalConv
from .names import flat_conv_names
from .reach import Reach, history_frames
from .trans_conv import CausalTransConv

__all__ = ["CausalConv", "CausalTransConv", "StatefulBlock", "StreamActivation", "StreamContext",
           "StreamSequential", "Reach", "activated_join", "assign_state_keys", "flat_conv_names", "history_frames",
           "zero_state"]
