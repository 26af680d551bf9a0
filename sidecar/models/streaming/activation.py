"""What the kit needs from an activation, and the activation fused with a conv's state join.

A kit conv may apply the activation before it (``act``) with its state join, and one after it (``then_act``) in
its epilogue. Where the activation runs fused (``runs_fused``: the family switched its kernels on, a CUDA tensor,
``torch.compile`` not tracing), the conv hands ``kernel_params()`` to the Snake kernels (``kernels/snake.py`` and
the ops built on it); elsewhere it calls the activation's own ``forward``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...kernels import snake, state_cat
from .base import StreamContext

CALLED_OPS = (snake.snake_cat,)
"""The kernel op ``activated_join`` calls as ``torch.ops.code2wav.*`` (importing its module registers it)."""


class StreamActivation(nn.Module):
    """A per-channel activation the Snake kernels can apply. ``fused`` is set by ``conv_choice.switch_kernels``
    (a family's ``use_fused_kernels``)."""

    fused = False

    def runs_fused(self, x: Tensor) -> bool:
        """Whether the conv next to it applies it with a kernel op (else with ``forward``)."""
        return self.fused and x.is_cuda and not torch.compiler.is_compiling()

    def kernel_params(self) -> tuple[Tensor, Tensor, bool]:
        """``(alpha [C], beta [C], log_params)`` as the Snake kernels take them (``kernels/snake.py``)."""
        raise NotImplementedError

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


def activated_join(act: StreamActivation | None, x: Tensor, lengths: Tensor, ctx: StreamContext, key: str,
                   num_state_cols: int, in_bias: Tensor | None = None, channels_last: bool = False,
                   join_op: bool = False) -> Tensor:
    """``[state, act(x)]`` ``[B, C, P + T]`` (just ``act(x)`` where ``num_state_cols`` is 0), the new state tail
    written to ``ctx.state_out[key]``: one kernel op (``code2wav::snake_cat``) where ``act`` runs fused, else torch
    ops (``act`` None: no activation).

    Only where ``act`` runs fused: ``in_bias`` ``[C]``, the biases still pending on ``x`` (``pending.run_chain``),
    added before the activation; ``channels_last``: the result with its channels contiguous. ``join_op``: where no
    fused activation joins the state, the join and the tail as one op (``state_cat.join``; the conv's
    ``kernels_on``)."""
    if act is not None and act.runs_fused(x):
        alpha, beta, log_params = act.kernel_params()
        state = ctx.state_in[key] if num_state_cols else None
        x_cat, tail = torch.ops.code2wav.snake_cat(x, state, alpha, beta, lengths, log_params,
                                                   in_bias, channels_last)  # [B, C, P + T]
        if num_state_cols:
            ctx.state_out[key] = tail  # [B, C, P]
        return x_cat
    if in_bias is not None:
        raise ValueError("in_bias needs the fused kernel (act.runs_fused(x))")
    if act is not None:
        x, _ = act(x, lengths, ctx)  # [B, C, T]
    if not num_state_cols:
        return x
    x_cat, ctx.state_out[key] = state_cat.join(x, ctx.state_in[key], lengths, op=join_op)  # [B, C, P + T], [B, C, P]
    return x_cat
