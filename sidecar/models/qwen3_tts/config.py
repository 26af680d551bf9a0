"""Decoder configuration of the Qwen3-TTS 12 Hz codec decoder (``decoder_config`` in ``config.json``).

Validated once, at load: unknown keys are kept out of the typed fields but known ones are checked for
type and range, so a broken checkpoint folder fails with the field's name instead of a shape error deep
inside a forward.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..streaming import reach

# Keys the upstream config carries that the decoder does not use. They are accepted and ignored; any other
# unknown key is an error (a typo in a hand-written config must not pass silently).
_IGNORED_KEYS = frozenset({"attention_dropout", "layer_scale_initial_scale"})


class DecoderConfig(BaseModel):
    """The fields of ``decoder_config``; defaults are the shipped Qwen3-TTS-12Hz values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    codebook_size: int = Field(2048, ge=1)
    num_quantizers: int = Field(16, ge=2)
    codebook_dim: int = Field(512, ge=2)
    hidden_size: int = Field(512, ge=1)
    num_attention_heads: int = Field(16, ge=1)
    num_key_value_heads: int = Field(16, ge=1)
    head_dim: int = Field(64, ge=2)
    intermediate_size: int = Field(1024, ge=1)
    num_hidden_layers: int = Field(8, ge=0)
    sliding_window: int = Field(72, ge=1)
    latent_dim: int = Field(1024, ge=1)
    decoder_dim: int = Field(1536, ge=1)
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    max_position_embeddings: int = Field(8000, ge=1)
    attention_bias: bool = False
    hidden_act: str = "silu"

    @model_validator(mode="after")
    def _check(self) -> "DecoderConfig":
        if self.codebook_dim % 2:
            raise ValueError(f"codebook_dim must be even (split in two VQ groups), got {self.codebook_dim}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding), got {self.head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("num_key_value_heads must equal num_attention_heads (the decoder has no grouped-query attention)")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if any(r < 1 for r in self.upsample_rates + self.upsampling_ratios):
            raise ValueError("upsample_rates and upsampling_ratios must be >= 1")
        if self.decoder_dim % (2 ** len(self.upsample_rates)):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve {len(self.upsample_rates)} times")
        return self

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def history_frames(self) -> int:
        """``H`` (``streaming/reach.py``): frames that determine a stream's state. The layers that look back, in
        forward order: ``pre_conv`` (k3); the transformer layers, each query seeing ``sliding_window - 1`` earlier
        positions (they compound: ``num_hidden_layers * (W - 1)``); per upsampling stage a transposed conv (kernel =
        stride) and ConvNeXt's depthwise k7; ``decoder.0`` (k7); per decoder block a transposed conv (``2r``,
        ``r``) and three residual k7 convs of dilation 1, 3, 9; the last conv (k7). 580 for the shipped config."""
        layers = [reach.conv(3)] + [reach.attention(self.sliding_window - 1)] * self.num_hidden_layers
        return reach.history_frames(layers + self._after_transformer())

    @property
    def tail_frames(self) -> int:
        """The same walk over the layers after the transformer only: how many of the transformer's last output
        frames determine the convolutions' state (10 for the shipped config). A step that returns no audio (a
        history replay) runs those layers over that tail only (``Qwen3TTSDecoder.forward_stream``)."""
        return reach.history_frames(self._after_transformer())

    def _after_transformer(self) -> list:
        layers = []
        for ratio in self.upsampling_ratios:
            layers += [reach.trans_conv(ratio, ratio), reach.conv(7)]
        layers.append(reach.conv(7))
        for rate in self.upsample_rates:
            layers += [reach.trans_conv(2 * rate, rate), reach.conv(7, 1), reach.conv(7, 3), reach.conv(7, 9)]
        layers.append(reach.conv(7))
        return layers

    @classmethod
    def from_checkpoint_dict(cls, decoder_config: dict) -> "DecoderConfig":
        """Build from a checkpoint's ``decoder_config``: drops the keys the decoder does not use."""
        if not isinstance(decoder_config, dict):
            raise ValueError(f"decoder_config must be a JSON object, got {type(decoder_config).__name__}")
        kept = {k: v for k, v in decoder_config.items() if k not in _IGNORED_KEYS}
        return cls.model_validate(kept)


SHIPPED = DecoderConfig()
SAMPLE_RATE_HZ = 24000
