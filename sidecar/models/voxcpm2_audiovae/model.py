"""VoxCPM2's AudioVAE (V2) decoder as one streaming network: float latents ``[B, D, T]`` -> 48 kHz audio.

``VoxCPM2AudioVAEDecoder.forward_stream(latents, num_frames, state, start_positions, sr_bucket)`` decodes a
batch of chunks, each row continuing its own stream from ``state``; a zero state gives the one-shot decode.
The call matches the Qwen3 family's ``forward_stream(codes, num_frames, state, start_positions)`` (positions
are accepted and unused: nothing here depends on the absolute position) plus the per-row sample-rate bucket.
Parameter names under ``decoder.`` are the checkpoint's after weight-norm folding, with the streaming kit's conv
level added (``model.0.conv.weight`` for the file's ``model.0.weight``; ``checkpoint_state_dict`` has the file's).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...kernels import conv_choice
from ...kernels.pending import BiasSum
from ..streaming import CausalConv, StreamContext, assign_state_keys, flat_conv_names, zero_state
from .blocks import DepthwiseDecoderBlock, ScaleBias, Snake
from .config import AudioVAEConfig

SR_BUCKET = "sr_bucket"
"""The per-row condition (``StreamContext.conditions``) the ``ScaleBias`` layers read: ``[B]`` long buckets."""


class LatentsToWaveNet(nn.Module):
    """Everything under the checkpoint prefix ``decoder.``: ``model.0 .. model.{3+n}``, ``sr_cond_model.{2+i}``
    and the int32 buffer ``sr_bin_boundaries``; latents ``[B, D, T]`` to the waveform."""

    def __init__(self, cfg: AudioVAEConfig) -> None:
        super().__init__()
        latent = cfg.latent_channels
        blocks = cfg.block_channels()
        out_dim = blocks[-1][1]
        self.model = nn.ModuleList(
            [CausalConv(latent, latent, 7, groups=latent), CausalConv(latent, cfg.decoder_dim, 1)]
            + [DepthwiseDecoderBlock(cin, cout, s) for cin, cout, s in blocks]
            + [Snake(out_dim), CausalConv(out_dim, 1, 7)])
        self.sr_cond_model = nn.ModuleDict(
            {str(2 + i): ScaleBias(cfg.num_sr_buckets, cin) for i, (cin, _, _) in enumerate(blocks)})
        self.register_buffer("sr_bin_boundaries", torch.tensor(cfg.sr_bin_boundaries, dtype=torch.int32))
        self.num_blocks = len(blocks)
        self.out_bias = BiasSum()  # the last block's pending biases' sum, added by the last layer's kernel

    def forward(self, x: Tensor, lengths: Tensor, ctx: StreamContext) -> Tensor:
        """``x`` ``[B, D, T]`` -> ``[B, 1, T * U]`` (after tanh)."""
        x, lengths = self.model[0](x, lengths, ctx)  # [B, D, T]
        x, lengths = self.model[1](x, lengths, ctx)  # [B, C, T]
        pending: tuple[Tensor, ...] = ()  # biases a block left on x (fused: pending.run_chain), added by the next
        for i in range(self.num_blocks):
            x = self.sr_cond_model[str(2 + i)](x, ctx.conditions[SR_BUCKET], pending)  # [B, Cin_i, T * R_i]
            x, lengths, pending = self.model[2 + i](x, lengths, ctx)  # [B, Cout_i, T * R_{i+1}]
        act, out_conv = self.model[2 + self.num_blocks], self.model[3 + self.num_blocks]
        x, lengths = out_conv(x, lengths, ctx, act=act, in_bias=self.out_bias(pending))  # [B, 1, T * U]
        return torch.tanh(x)


class VoxCPM2AudioVAEDecoder(nn.Module):
    """Streaming wrapper around ``decoder`` (the checkpoint's ``decoder.*``) with the stream-state contract."""

    def __init__(self, cfg: AudioVAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder = LatentsToWaveNet(cfg)
        self.samples_per_frame = cfg.samples_per_frame
        self.latent_dim = cfg.latent_channels
        # conv input tails and the last input frame of each transposed conv
        self._state_layout = assign_state_keys(self.decoder)

    def use_fused_kernels(self, enabled: bool) -> bool:
        """Snake + the next conv's state concatenation as one Triton kernel on CUDA (``kernels/snake.py``: before
        the residual units' depthwise convs and the transposed convs), every depthwise conv (with the Snake after it
        in the residual units: ``kernels/depthwise.py``), Snake + the last conv (``kernels/snake_conv.py``), or torch
        ops everywhere.
        In float32 the GEMMs (transposed convs, 1x1 convs) may then run as ``kernels/matmul.py``'s 3xTF32 kernel
        where it measures faster than cuBLAS. Returns whether the kernels are in use (False without Triton)."""
        return conv_choice.switch_kernels(self, Snake, enabled)

    def state_layout(self) -> dict[str, tuple[int, ...]]:
        """Per-row shape of every state entry (stored in the model's dtype)."""
        return dict(self._state_layout)

    def zero_state(self, batch: int) -> dict[str, Tensor]:
        p = next(self.parameters())
        return zero_state(self._state_layout, batch, p.dtype, p.device)

    def checkpoint_state_dict(self) -> dict[str, Tensor]:
        """The state dict under the checkpoint's names after weight-norm folding (``decoder.model.0.weight``; the
        module's own names have the kit convs' ``.conv`` level, ``streaming.flat_conv_names``)."""
        names = flat_conv_names(self.decoder)
        return {"decoder." + names.get(k, k): v for k, v in self.decoder.state_dict().items()}

    def sr_bucket(self, sr_cond_hz: Tensor | int | None, batch: int = 1) -> Tensor:
        """Buckets ``[batch]`` (long) of per-row sample rates in Hz (``[B]``, ``[1]`` or a scalar; None: the
        default ``out_sample_rate``), with the checkpoint's integer boundaries (``right=False``)."""
        device = self.decoder.sr_bin_boundaries.device
        if sr_cond_hz is None:
            sr_cond_hz = self.cfg.out_sample_rate
        hz = torch.as_tensor(sr_cond_hz, device=device).reshape(-1)  # [B] or [1]
        if hz.dtype.is_floating_point or hz.dtype == torch.bool or hz.numel() not in (1, batch):
            raise ValueError(f"sr_cond: expected {batch} or 1 integer rates in Hz, got {hz.dtype} "
                             f"of shape {tuple(hz.shape)}")
        hz = hz.to(torch.int64)
        buckets = torch.bucketize(hz, self.decoder.sr_bin_boundaries.to(torch.int64), right=False)  # [B] or [1]
        return buckets.expand(batch).contiguous()

    def forward_stream(self, latents: Tensor, num_frames: Tensor | None, state: dict[str, Tensor],
                       start_positions: Tensor | None = None,
                       sr_bucket: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Decode ``latents`` ``[B, D, n]`` continuing each row's stream.

        ``num_frames`` ``[B]``: valid frames per row (the rest is right padding: it never reaches the state, and
        row ``b``'s audio is valid for ``num_frames[b] * U`` samples); None means all ``n``. ``state``:
        ``{key: [B, ...]}`` as in ``state_layout()``. ``start_positions``: unused (no positional dependence).
        ``sr_bucket`` ``[B]`` long (see ``sr_bucket()``); None: the default bucket for every row.
        Returns float32 audio ``[B, n * U]`` and the new state. ``n == 0`` gives empty audio and the same state.
        """
        batch, channels, length = latents.shape
        if channels != self.latent_dim:
            raise ValueError(f"latents: expected [B, {self.latent_dim}, T], got {list(latents.shape)}")
        if length == 0:
            return latents.new_zeros((batch, 0), dtype=torch.float32), dict(state)
        device = latents.device
        if num_frames is None:
            num_frames = torch.full((batch,), length, dtype=torch.long, device=device)
        if sr_bucket is None:
            sr_bucket = torch.full((batch,), self.cfg.default_sr_bucket, dtype=torch.long, device=device)
        dtype = next(self.parameters()).dtype
        ctx = StreamContext(state_in=state, conditions={SR_BUCKET: sr_bucket})
        wav = self.decoder(latents.to(dtype), num_frames, ctx)  # [B, 1, n * U]
        return wav.float()[:, 0], ctx.state_out  # [B, n * U]

    def forward(self, latents: Tensor, sr_bucket: Tensor | None = None) -> Tensor:
        """One-shot decode: ``latents`` ``[B, D, T]`` -> ``[B, 1, T * U]`` float32."""
        batch = latents.shape[0]
        wav, _ = self.forward_stream(latents, None, self.zero_state(batch), None, sr_bucket)
        return wav[:, None]
