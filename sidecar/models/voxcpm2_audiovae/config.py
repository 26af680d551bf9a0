"""Configuration of VoxCPM2's AudioVAE (V2) decoder: ``audio_vae_config`` in the model folder's ``config.json``.

The shipped file names 8 keys (all equal to the defaults below); the other 5 fields keep their defaults. Only the
shipped variant is implemented (depthwise convs, no noise block, scale/bias sample-rate conditioning without an
output layer); any other value is refused with the field's name. Unknown keys are refused too (a typo must not
pass silently), unlike upstream, which ignores them.
"""

from __future__ import annotations

import bisect
import math
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..streaming import reach


class AudioVAEConfig(BaseModel):
    """The fields of ``audio_vae_config``; defaults are the shipped VoxCPM2 values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    encoder_dim: int = Field(128, ge=1)  # encoder only
    encoder_rates: tuple[int, ...] = (2, 5, 8, 8)  # encoder only
    latent_dim: int | None = Field(64, ge=1)  # None: encoder_dim * 2**len(encoder_rates)
    decoder_dim: int = Field(2048, ge=1)
    decoder_rates: tuple[int, ...] = (8, 6, 5, 2, 2, 2)
    sr_bin_boundaries: tuple[int, ...] | None = (20000, 30000, 40000)
    sample_rate: int = Field(16000, ge=1)  # the encoder's input rate
    out_sample_rate: int = Field(48000, ge=1)
    depthwise: bool = True
    use_noise_block: bool = False
    cond_type: str = "scale_bias"
    cond_dim: int = Field(128, ge=1)
    cond_out_layer: bool = False

    @model_validator(mode="after")
    def _check(self) -> "AudioVAEConfig":
        unsupported = []
        if not self.depthwise:
            unsupported.append("depthwise false (only the depthwise layout is implemented)")
        if self.use_noise_block:
            unsupported.append("use_noise_block true (it adds random noise; not deterministic)")
        if self.cond_type != "scale_bias":
            unsupported.append(f"cond_type {self.cond_type!r} (only 'scale_bias' is implemented)")
        if self.cond_out_layer:
            unsupported.append("cond_out_layer true (only the layout without it is implemented)")
        if self.sr_bin_boundaries is None:
            unsupported.append("sr_bin_boundaries null (only the sample-rate-conditioned layout is implemented)")
        if unsupported:
            raise ValueError("unsupported audio_vae_config: " + "; ".join(unsupported)
                             + " - this sidecar implements the shipped VoxCPM2 AudioVAE V2 decoder")
        if not self.decoder_rates or any(r < 1 for r in self.decoder_rates):
            raise ValueError(f"decoder_rates must be a non-empty list of integers >= 1, got {list(self.decoder_rates)}")
        if self.decoder_dim % (2 ** len(self.decoder_rates)):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve {len(self.decoder_rates)} times "
                             f"(once per decoder rate)")
        bounds = self.sr_bin_boundaries or ()
        if list(bounds) != sorted(bounds):
            raise ValueError(f"sr_bin_boundaries must be ascending, got {list(bounds)}")
        return self

    @property
    def latent_channels(self) -> int:
        """``D``: channels of a latent frame (``latent_dim``, or the encoder's output width when null)."""
        if self.latent_dim is not None:
            return self.latent_dim
        return self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def samples_per_frame(self) -> int:
        """``U = prod(decoder_rates)``: output samples per latent frame."""
        return math.prod(self.decoder_rates)

    @property
    def frame_rate_hz(self) -> float:
        return self.out_sample_rate / self.samples_per_frame

    @property
    def num_sr_buckets(self) -> int:
        return len(self.sr_bin_boundaries or ()) + 1

    def sr_bucket(self, sr_cond_hz: int) -> int:
        """Bucket of a sample rate in Hz: boundaries strictly below it (``torch.bucketize``, ``right=False``)."""
        return bisect.bisect_left(list(self.sr_bin_boundaries or ()), int(sr_cond_hz))

    @property
    def default_sr_bucket(self) -> int:
        """Bucket of the default ``sr_cond`` (``out_sample_rate``): 3 for the shipped config."""
        return self.sr_bucket(self.out_sample_rate)

    def block_channels(self) -> list[tuple[int, int, int]]:
        """``(Cin_i, Cout_i, stride_i)`` of each upsampling block."""
        dim = self.decoder_dim
        return [(dim // 2 ** i, dim // 2 ** (i + 1), s) for i, s in enumerate(self.decoder_rates)]

    @property
    def history_frames(self) -> int:
        """``H`` (``streaming/reach.py``): latent frames an output frame and a stream's state depend on. The
        layers that look back, in forward order: ``model.0`` (depthwise k7); per block a transposed conv (``2s``,
        ``s``) and three residual k7 convs of dilation 1, 3, 9; the last conv (k7). 20 for the shipped config."""
        layers = [reach.conv(7)]
        for stride in self.decoder_rates:
            layers += [reach.trans_conv(2 * stride, stride), reach.conv(7, 1), reach.conv(7, 3), reach.conv(7, 9)]
        layers.append(reach.conv(7))
        return reach.history_frames(layers)


SHIPPED = AudioVAEConfig()
