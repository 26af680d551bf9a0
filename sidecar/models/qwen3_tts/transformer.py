"""The decoder's sliding-window transformer (``pre_transformer``), written for streaming.

State per layer: post-rotary keys and values of the last ``sliding_window - 1`` positions, ``[H, W-1, D]``
each. Positions are absolute per stream (the stream's frame counter), so a chunk continues exactly where
the previous one stopped; cache entries that would sit before position 0 are masked out, which makes a
zero state equal to "no history".

Two forms of each layer, the same maths. Where autograd is off and ``torch.compile`` is not tracing (the
sidecar's steps: eager and CUDA graphs), a layer runs in few kernels, since at batch 1 the step is bound by
kernel launches, not bytes: the q/k/v projections as one GEMM and gate/up as one (``StackedWeights``), the
rotary embedding over q and k together, written back into the projection's output, the new keys and values
joined to the cache with one ``cat`` and the next cache taken with one ``gather`` (where the family's kernels are
on, those three and the rotary embedding are one op, ``kernels/rope_cache.py``), the norms as
``F.rms_norm`` (one kernel on CUDA), each layer scale and residual add as one ``addcmul``: about 18 kernels a
layer instead of about 48. Where the family's kernels are on, each residual add and the norm after it are one op
and the MLP's gate is one (``kernels/layer_glue.py``): 9 ops a layer. Otherwise (``torch.compile``, which fuses
the plain form itself, and autograd) the plain form below runs: the checkpoint's modules one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels import layer_glue, rope_cache, window_inputs
from ...kernels.derived import DerivedTensor, kernel_forms
from ..streaming import StatefulBlock, StreamContext
from .config import DecoderConfig

CALLED_OPS = (layer_glue.add_rms_norm, layer_glue.silu_mul, rope_cache.rope_kv_cache, window_inputs.window_inputs)
"""The kernel ops the layers call as ``torch.ops.code2wav.*`` (importing their modules registers them)."""


class StackedWeights:
    """The weights (and biases) of several ``nn.Linear`` stacked by rows, so their GEMMs over one input run as
    one; made once and kept as ``kernels/derived.py`` says (made again when a source parameter changed)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self._linears = linears
        self._stacked: DerivedTensor[tuple[Tensor, Tensor | None]] = DerivedTensor()

    def get(self) -> tuple[Tensor, Tensor | None]:
        """``(weight [sum of out, in], bias [sum of out] or None)``."""
        linears = self._linears
        sources = [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
        return self._stacked.get(sources, lambda: (
            torch.cat([lin.weight.detach() for lin in linears]),  # [sum out, in]
            None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])))  # [sum out]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if kernel_forms():  # one kernel on CUDA; the same maths, rounded once at the end
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x

    def add_scaled(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + scale * x``: one kernel in the few-kernel form."""
        if kernel_forms():
            return torch.addcmul(residual, self.scale, x)
        return residual + self(x)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = StackedWeights([self.gate_proj, self.up_proj])
        self.kernels_on = False  # the gate as one op (kernels/layer_glue.py), set by ``conv_choice.switch_kernels``

    def forward(self, x: Tensor) -> Tensor:
        if kernel_forms():
            weight, _ = self.gate_up.get()
            gate_up = F.linear(x, weight)  # [B, T, 2I]
            if self.kernels_on:
                return self.down_proj(torch.ops.code2wav.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)  # [B, T, I] each
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(StatefulBlock):
    """Multi-head attention over a sliding window; state = rotated K and V of the last ``W - 1`` positions."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        inner = cfg.num_attention_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, inner, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, inner, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, inner, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.attention_bias)
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.num_cached = cfg.sliding_window - 1
        self.qkv = StackedWeights([self.q_proj, self.k_proj, self.v_proj])
        # the few-kernel form's rotary embedding and cache update as one op (``kernels/rope_cache.py``: a Triton
        # kernel on CUDA), where the family switched its kernels on (set by ``conv_choice.switch_kernels``)
        self.kernels_on = False

    def state_shape(self) -> tuple[int, ...] | None:
        # K and V stacked: [2, H, W-1, D]
        return (2, self.num_heads, self.num_cached, self.head_dim) if self.num_cached else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, lengths: Tensor,
                ctx: StreamContext, cache_index: Tensor | None = None) -> Tensor:
        """``rope``: ``(cos, sin)`` ``[B, T, D]``; ``mask`` ``[B, 1, T, W-1+T]``; ``lengths`` ``[B]`` valid new
        positions per row (the next cache ends at each row's last valid one). With ``cache_index`` (from
        ``PreTransformer.few_kernel_inputs``, the same for every layer) the few-kernel form runs, and ``rope``'s
        second tensor is its signed sine."""
        if cache_index is not None:
            return self._few_kernels(x, rope, mask, lengths, cache_index, ctx)
        batch, num_new, _ = x.shape
        cos, sin = rope[0][:, None], rope[1][:, None]  # [B, 1, T, D] each
        q = self.q_proj(x).view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        v = self.v_proj(x).view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.num_cached:
            cache = ctx.state_in[self.state_key].to(x.dtype)  # [B, 2, H, W-1, D]
            k = torch.cat([cache[:, 0], k], dim=2)  # [B, H, W-1+T, D]
            v = torch.cat([cache[:, 1], v], dim=2)  # [B, H, W-1+T, D]
            offsets = torch.arange(self.num_cached, device=x.device)  # [W-1]
            index = (lengths[:, None] + offsets[None, :])[:, None, :, None]  # [B, 1, W-1, 1]
            index = index.expand(batch, self.num_heads, self.num_cached, self.head_dim)  # [B, H, W-1, D]
            ctx.state_out[self.state_key] = torch.stack(
                [torch.gather(k, 2, index), torch.gather(v, 2, index)], dim=1)  # [B, 2, H, W-1, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))  # [B, T, hidden]

    def _few_kernels(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, lengths: Tensor,
                     cache_index: Tensor, ctx: StreamContext) -> Tensor:
        """``forward``'s maths in about 9 kernels: one GEMM for q/k/v; the rotary embedding of q and k together,
        in place in its output (``x * cos + rotate_half(x) * sin`` as ``x * cos + swap_halves(x) * signed sin``,
        the same numbers); one ``cat`` with the cache and one ``gather`` for the next cache. With ``kernels_on``
        the rotary embedding, the join with the cache and the next cache are one op (``kernels/rope_cache.py``)."""
        batch, num_new, _ = x.shape
        heads, dim = self.num_heads, self.head_dim
        weight, bias = self.qkv.get()
        qkv = F.linear(x, weight, bias).view(batch, num_new, 3, heads, dim)  # [B, T, 3, H, D]
        if self.kernels_on and self.num_cached:
            q, kv, ctx.state_out[self.state_key] = torch.ops.code2wav.rope_kv_cache(
                qkv, rope[0], rope[1], ctx.state_in[self.state_key], lengths)  # [B, T, H, D], [B, 2, H, W-1+T, D]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), kv[:, 0], kv[:, 1], attn_mask=mask)  # [B, H, T, D]
            return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))  # [B, T, hidden]
        qk = qkv[:, :, :2]  # [B, T, 2, H, D] (a view)
        cos, signed_sin = rope[0][:, :, None, None], rope[1][:, :, None, None]  # [B, T, 1, 1, D] each
        half = dim // 2
        halves_swapped = torch.cat([qk[..., half:], qk[..., :half]], dim=-1)  # [B, T, 2, H, D] (strided reads)
        qk.mul_(cos).addcmul_(halves_swapped, signed_sin)  # rotated in place
        q = qkv[:, :, 0].transpose(1, 2)  # [B, H, T, D]
        kv_new = qkv[:, :, 1:].permute(0, 2, 3, 1, 4)  # [B, 2, H, T, D]
        if self.num_cached:
            cache = ctx.state_in[self.state_key].to(x.dtype)  # [B, 2, H, W-1, D]
            kv = torch.cat([cache, kv_new], dim=3)  # [B, 2, H, W-1+T, D]
            index = cache_index.expand(batch, 2, heads, self.num_cached, dim)  # [B, 2, H, W-1, D]
            ctx.state_out[self.state_key] = torch.gather(kv, 3, index)  # [B, 2, H, W-1, D]
        else:
            kv = kv_new
        out = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=mask)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))  # [B, T, hidden]


class TransformerLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, lengths: Tensor,
                ctx: StreamContext, cache_index: Tensor | None = None) -> Tensor:
        x = self.self_attn_layer_scale.add_scaled(x, self.self_attn(self.input_layernorm(x), rope, mask, lengths,
                                                                     ctx, cache_index))  # [B, T, hidden]
        return self.mlp_layer_scale.add_scaled(x, self.mlp(self.post_attention_layernorm(x)))  # [B, T, hidden]

    def forward_normed(self, x: Tensor, x_normed: Tensor, next_norm: RMSNorm, rope: tuple[Tensor, Tensor],
                       mask: Tensor, lengths: Tensor, ctx: StreamContext,
                       cache_index: Tensor | None) -> tuple[Tensor, Tensor]:
        """The few-kernel form with each residual add and the norm after it as one op (``kernels/layer_glue.py``):
        ``x_normed`` is ``input_layernorm(x)`` (the layer before made it with its last add); returns the layer's
        output and ``next_norm`` of it (the next layer's input norm, or the transformer's final one)."""
        attn = self.self_attn(x_normed, rope, mask, lengths, ctx, cache_index)  # [B, T, hidden]
        norm = self.post_attention_layernorm
        h, h_normed = torch.ops.code2wav.add_rms_norm(x, attn, self.self_attn_layer_scale.scale, norm.weight,
                                                      norm.eps)  # [B, T, hidden] each
        return torch.ops.code2wav.add_rms_norm(h, self.mlp(h_normed), self.mlp_layer_scale.scale, next_norm.weight,
                                               next_norm.eps)  # [B, T, hidden] each


class PreTransformer(nn.Module):
    """``input_proj`` -> layers -> ``norm`` -> ``output_proj`` on ``[B, T, latent]``."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.window = cfg.sliding_window
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self._inv_freq: dict[torch.device, Tensor] = {}
        # the few-kernel form's per-step inputs as one op (a Triton kernel on CUDA), and each residual add with the
        # norm after it as one, where the family switched its kernels on (set by ``conv_choice.switch_kernels``)
        self.kernels_on = False

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` ``[B, T, D]`` of ``positions`` ``[B, T]``."""
        return window_inputs.rotary(positions, self.inverse_frequencies(positions.device), dtype)

    def inverse_frequencies(self, device: torch.device) -> Tensor:
        """The rotary inverse frequencies ``[D/2]`` in float32 (not a buffer: a dtype cast of the module must not
        round them), made once per device (not kept when made inside a CUDA graph capture, which does not run
        them, nor under ``torch.compile``, which traces them)."""
        if torch.compiler.is_compiling():
            return window_inputs.inverse_frequencies(self.head_dim, self.rope_theta, device)  # [D/2]
        made = self._inv_freq.get(device)
        if made is None:
            made = window_inputs.inverse_frequencies(self.head_dim, self.rope_theta, device)  # [D/2]
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._inv_freq[device] = made
        return made

    def window_mask(self, start_positions: Tensor, num_new: int) -> Tensor:
        """Query ``i`` sees keys ``j`` with ``i - W < j <= i`` and ``j >= 0``; keys are cache then new."""
        return window_inputs.window_mask(start_positions, num_new, self.window)  # [B, 1, T, W-1+T]

    def forward(self, x: Tensor, start_positions: Tensor, lengths: Tensor, ctx: StreamContext) -> Tensor:
        num_new = x.shape[1]
        cache_index = None
        if kernel_forms() and self.kernels_on:  # one op (kernels/window_inputs.py)
            cos, signed_sin, mask, cache_index = torch.ops.code2wav.window_inputs(
                start_positions, lengths, self.inverse_frequencies(x.device), num_new, self.window, x.dtype)
            rope = (cos, signed_sin)
        else:
            positions = start_positions[:, None] + torch.arange(num_new, device=x.device)[None, :]  # [B, T]
            rope = self.rope(positions, x.dtype)
            mask = self.window_mask(start_positions, num_new)
            if kernel_forms():
                rope, cache_index = self.few_kernel_inputs(rope, lengths)
        h = self.input_proj(x)  # [B, T, hidden]
        if kernel_forms() and self.kernels_on:  # each residual add with the norm after it (kernels/layer_glue.py)
            norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
            normed = norms[0](h)  # [B, T, hidden]
            for layer, next_norm in zip(self.layers, norms[1:]):
                h, normed = layer.forward_normed(h, normed, next_norm, rope, mask, lengths, ctx, cache_index)
            return self.output_proj(normed)  # [B, T, latent]
        for layer in self.layers:
            h = layer(h, rope, mask, lengths, ctx, cache_index)
        return self.output_proj(self.norm(h))  # [B, T, latent]

    def few_kernel_inputs(self, rope: tuple[Tensor, Tensor], lengths: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """What every layer's few-kernel form shares, computed once per step: ``(cos, signed sin)`` (``[B, T, D]``,
        the sine's first half negated: ``rotate_half(x) * sin == swap_halves(x) * signed sin``) and the next cache's
        positions in ``[cache, new]``, ``[B, 1, 1, W-1, 1]`` (the ``W-1`` ending at each row's last valid one).
        With ``kernels_on`` these, the rotary tables and the mask are one op (``kernels/window_inputs.py``)."""
        cos, sin = rope
        return (cos, window_inputs.signed_sine(sin)), window_inputs.cache_index(lengths, self.window - 1)
