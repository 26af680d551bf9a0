"""The Qwen3-TTS 12 Hz codec decoder as one streaming network.

``Qwen3TTSDecoder.forward_stream(codes, num_frames, state, start_positions)`` decodes a batch of chunks,
each row continuing its own stream from ``state``; a zero state and position 0 give the one-shot decode.
Parameter names (under the checkpoint prefix ``decoder.``) match ``speech_tokenizer/model.safetensors``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...kernels import conv_choice
from ...kernels.pending import BiasSum, folds_biases, run_chain
from ..streaming import CausalConv, CausalTransConv, StreamContext, StreamSequential, assign_state_keys, zero_state
from .blocks import ConvNeXt, DenseDecoderBlock, SnakeBeta
from .config import DecoderConfig
from .transformer import PreTransformer


class Codebook(nn.Module):
    def __init__(self, codebook_size: int, dim: int) -> None:
        super().__init__()
        self.embedding_sum = nn.Parameter(torch.zeros(codebook_size, dim))
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))

    def embedding(self) -> Tensor:
        return self.embedding_sum / torch.clamp(self.cluster_usage, min=1e-5)[:, None]  # [K, d]


class VQLayer(nn.Module):
    def __init__(self, codebook_size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(codebook_size, dim)


class VQStack(nn.Module):
    def __init__(self, num_layers: int, codebook_size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([VQLayer(codebook_size, dim) for _ in range(num_layers)])


class VQGroup(nn.Module):
    """One group of the split residual VQ: ``vq.layers.j._codebook``, ``input_proj`` (unused), ``output_proj``."""

    def __init__(self, num_layers: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        half = codebook_dim // 2
        self.vq = VQStack(num_layers, codebook_size, half)
        self.input_proj = nn.Conv1d(codebook_dim, half, 1, bias=False)  # encoder side; loaded, not used
        self.output_proj = nn.Conv1d(half, codebook_dim, 1, bias=False)


class SplitRVQ(nn.Module):
    """``rvq_first`` takes quantizer 0, ``rvq_rest`` quantizers 1..Q-1; groups summed after ``output_proj``."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.rvq_first = VQGroup(1, cfg.codebook_size, cfg.codebook_dim)
        self.rvq_rest = VQGroup(cfg.num_quantizers - 1, cfg.codebook_size, cfg.codebook_dim)
        self.codebook_size = cfg.codebook_size

    def tables(self) -> Tensor:
        """All codebooks as one lookup table ``[Q * K, d]`` (quantizer-major)."""
        books = [layer._codebook.embedding() for g in (self.rvq_first, self.rvq_rest) for layer in g.vq.layers]
        return torch.cat(books, dim=0)

    def forward(self, codes: Tensor, table: Tensor) -> Tensor:
        num_q = codes.shape[1]
        offsets = torch.arange(num_q, device=codes.device)[None, :, None] * self.codebook_size  # [1, Q, 1]
        emb = nn.functional.embedding(codes + offsets, table)  # [B, Q, T, d]
        first = emb[:, 0].transpose(1, 2)  # [B, d, T]
        rest = emb[:, 1:].sum(dim=1).transpose(1, 2)  # [B, d, T]
        return self.rvq_first.output_proj(first) + self.rvq_rest.output_proj(rest)  # [B, codebook_dim, T]


class CodesToWaveNet(nn.Module):
    """Everything under the checkpoint prefix ``decoder.``: codes ``[B, Q, T]`` to the waveform."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList([
            StreamSequential([CausalTransConv(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXt(cfg.latent_dim)])
            for r in cfg.upsampling_ratios
        ])
        layers: list[nn.Module] = [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
        dim = cfg.decoder_dim
        for rate in cfg.upsample_rates:
            layers.append(DenseDecoderBlock(dim, dim // 2, rate))
            dim //= 2
        layers += [SnakeBeta(dim), CausalConv(dim, 1, 7)]
        self.decoder = StreamSequential(layers)


def last_frames(x: Tensor, lengths: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Each row's last ``count`` valid frames of ``x`` ``[B, C, T]`` (all of them, left-aligned, where it has fewer),
    and their number per row."""
    first = (lengths - count).clamp(min=0)  # [B]
    index = first[:, None] + torch.arange(count, device=x.device)  # [B, count]
    return x.gather(2, index[:, None, :].expand(-1, x.shape[1], -1)), lengths.clamp(max=count)  # [B, C, count]


class Qwen3TTSDecoder(nn.Module):
    """Streaming wrapper: owns ``decoder`` (the checkpoint's ``decoder.*``) and a cached codebook table."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder = CodesToWaveNet(cfg)
        self.samples_per_frame = cfg.samples_per_frame
        self._state_layout = assign_state_keys(self.decoder)  # the convs' tails and the attention caches
        self.register_buffer("codebook_table", torch.empty(0), persistent=False)
        self.out_bias = BiasSum()  # the blocks' pending biases' sum, added by the last Snake kernel

    def refresh_codebooks(self) -> None:
        """Recompute the lookup table after weights change (load, dtype or device move)."""
        with torch.no_grad():
            self.codebook_table = self.decoder.quantizer.tables().detach()

    def use_fused_kernels(self, enabled: bool) -> bool:
        """Snake + state concatenation as one Triton kernel on CUDA (``kernels/snake.py``; before the last conv,
        Snake + that conv: ``kernels/snake_conv.py``), or torch ops. Returns whether the kernels are in use (False
        without Triton)."""
        # with the conv and GEMM kernels' choices and every block's ``kernels_on`` (the depthwise convs, the
        # transformer's rotary and shared-inputs ops)
        return conv_choice.switch_kernels(self, SnakeBeta, enabled)

    def state_layout(self) -> dict[str, tuple[int, ...]]:
        """Per-row shape of every state entry (stored in the model's dtype)."""
        return dict(self._state_layout)

    def zero_state(self, batch: int) -> dict[str, Tensor]:
        p = next(self.parameters())
        return zero_state(self._state_layout, batch, p.dtype, p.device)

    def forward_stream(self, codes: Tensor, num_frames: Tensor, state: dict[str, Tensor],
                       start_positions: Tensor, tail_frames: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Decode ``codes`` ``[B, Q, T]`` continuing each row's stream.

        ``num_frames`` ``[B]``: valid frames per row (the rest is right padding, never reaching the state);
        ``state``: ``{key: [B, ...]}``; ``start_positions`` ``[B]``: frames the stream decoded before.
        Returns the float32 waveform ``[B, T * U]`` (row ``b`` is valid for ``num_frames[b] * U`` samples)
        and the new state after each row's last valid frame.

        ``tail_frames`` (a step whose audio nobody keeps: a history replay): the layers after the transformer run
        over each row's last ``tail_frames`` valid frames only (``cfg.tail_frames``: their state depends on no
        earlier frame, whatever state they start from), and the waveform is that tail's, ``[B, tail * U]``.
        """
        net = self.decoder
        ctx = StreamContext(state_in=state)
        dtype = self.codebook_table.dtype
        x = net.quantizer(codes, self.codebook_table).to(dtype)  # [B, codebook_dim, T]
        x, lengths = net.pre_conv(x, num_frames, ctx)  # [B, latent, T]
        x = net.pre_transformer(x.transpose(1, 2), start_positions, lengths, ctx).transpose(1, 2)  # [B, latent, T]
        if tail_frames is not None and x.shape[2] > tail_frames:
            x, lengths = last_frames(x, lengths, tail_frames)  # [B, latent, tail]
        for stage in net.upsample:
            x, lengths = stage(x, lengths, ctx)  # [B, latent, T * r]
        first_conv, *blocks, act, out_conv = net.decoder
        fold = folds_biases(act, x)  # biases left pending, added by the next kernel that reads x (run_chain)
        x, lengths = first_conv(x, lengths, ctx, bias_later=fold)  # [B, decoder_dim, T]
        x, lengths, pending = run_chain(blocks, x, lengths, ctx, (first_conv.conv.bias,) if fold else ())
        wav, _ = out_conv(x, lengths, ctx, act=act, in_bias=self.out_bias(pending))  # [B, 1, T * U]
        return wav.clamp(-1.0, 1.0).float()[:, 0], ctx.state_out  # [B, T * U]

    def forward(self, codes: Tensor) -> Tensor:
        """One-shot decode: ``codes`` ``[B, Q, T]`` -> ``[B, 1, T * U]`` float32."""
        batch, _, num_frames = codes.shape
        lengths = torch.full((batch,), num_frames, dtype=torch.long, device=codes.device)
        starts = torch.zeros(batch, dtype=torch.long, device=codes.device)
        wav, _ = self.forward_stream(codes, lengths, self.zero_state(batch), starts)
        return wav[:, None]
