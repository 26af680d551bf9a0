"""The decoder's sliding-window transformer (``pre_transformer``), written for streaming.

State per layer: post-rotary keys and values of the last ``sliding_window - 1`` positions, ``[H, W-1, D]``
each. Positions are absolute per stream (the stream's frame counter), so a chunk continues exactly where
the previous one stopped; cache entries that would sit before position 0 are masked out, which makes a
zero state equal to "no history".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import DecoderConfig
from .streaming import StatefulBlock, StreamCtx


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
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

    def state_shape(self) -> tuple[int, ...] | None:
        # K and V stacked: [2, H, W-1, D]
        return (2, self.num_heads, self.num_cached, self.head_dim) if self.num_cached else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, lengths: Tensor,
                ctx: StreamCtx) -> Tensor:
        batch, num_new, _ = x.shape
        cos, sin = rope  # [B, 1, T, D] each
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
                ctx: StreamCtx) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, mask, lengths, ctx))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


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

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # Computed in float32 on every call (not a buffer: a dtype cast of the module must not round it).
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponents)  # [D/2]
        angles = positions.float()[:, :, None] * inv_freq[None, None, :]  # [B, T, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def window_mask(self, start_positions: Tensor, num_new: int) -> Tensor:
        """Query ``i`` sees keys ``j`` with ``i - W < j <= i`` and ``j >= 0``; keys are cache then new."""
        device = start_positions.device
        num_cached = self.window - 1
        q_pos = start_positions[:, None] + torch.arange(num_new, device=device)[None, :]  # [B, T]
        k_pos = start_positions[:, None] - num_cached + torch.arange(num_cached + num_new, device=device)[None, :]
        diff = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, W-1+T]
        mask = (diff >= 0) & (diff < self.window) & (k_pos[:, None, :] >= 0)  # [B, T, W-1+T]
        return mask[:, None]  # [B, 1, T, W-1+T]

    def forward(self, x: Tensor, start_positions: Tensor, lengths: Tensor, ctx: StreamCtx) -> Tensor:
        num_new = x.shape[1]
        positions = start_positions[:, None] + torch.arange(num_new, device=x.device)[None, :]  # [B, T]
        rope = self.rope(positions, x.dtype)
        mask = self.window_mask(start_positions, num_new)
        h = self.input_proj(x)  # [B, T, hidden]
        for layer in self.layers:
            h = layer(h, rope, mask, lengths, ctx)
        return self.output_proj(self.norm(h))  # [B, T, latent]
