"""VoxCPM2's AudioVAE decoder as a ``DecoderFamily``: float latents ``[B, D, T]`` at 25 Hz -> 48 kHz audio.

One stream option, ``sr_cond`` (Hz, default the config's ``out_sample_rate``): the sample-rate condition the
decoder's scale/bias layers take. The forward maps each row's Hz to its bucket on the device
(``torch.bucketize`` against the checkpoint's boundaries), so a CUDA graph replays any mix of rates.
``--model voxcpm2-default`` serves the shipped architecture with seeded random weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import Tensor

from ..family import Contract, GraphBuckets, InputSpec, StreamBatch, StreamOption, state_specs
from .config import SHIPPED
from .loader import CONFIG_KEY, DEFAULT_SPEC, load_folder, random_model
from .model import VoxCPM2AudioVAEDecoder

SR_COND = "sr_cond"
SR_COND_RANGE_HZ = (1, 192000)
# VoxCPM2's talker emits one 4-frame latent patch per step (160 ms of audio); vLLM-Omni may gather a few patches
# per decode, and offline or resumed streams send longer chunks (25 frames = 1 s). Batches of 4-frame patches go
# to 64 rows (0.65 MB of state each); the 25-frame buckets past the graph memory budget are skipped (eager). Window
# mode: a patch with the decoder's 20 frames of history.
GRAPH_BUCKETS = GraphBuckets(exact_batch_sizes=(1, 2, 4, 8, 16, 32, 64), exact_frames=(4, 25),
                             window_batch_sizes=(1, 2, 4, 8), window_frames=(24,))


def contract_of(module: VoxCPM2AudioVAEDecoder) -> Contract:
    cfg = module.cfg
    sr_cond = StreamOption(SR_COND, SR_COND_RANGE_HZ[0], SR_COND_RANGE_HZ[1], cfg.out_sample_rate,
                           doc="sample-rate condition in Hz (bucketed by the checkpoint's sr_bin_boundaries)")
    return Contract(input=InputSpec("latents", cfg.latent_channels), sample_rate_hz=cfg.out_sample_rate,
                    samples_per_frame=cfg.samples_per_frame,
                    state=state_specs(module.state_layout()),
                    stream_options=(sr_cond,), history_frames=cfg.history_frames)


class VoxCPM2AudioVAEFamily:
    name = "voxcpm2_audiovae"
    default_model_name = "voxcpm2-audiovae"
    graph_buckets = GRAPH_BUCKETS
    default_spec = DEFAULT_SPEC  # ``--model voxcpm2-default``: this family's random-weights model

    def recognises(self, config: Mapping[str, Any]) -> bool:
        """A VoxCPM2 model folder's ``config.json``: an ``audio_vae_config`` object (checked at load), or
        ``architecture: voxcpm2`` (the decoder config then takes its shipped defaults)."""
        return isinstance(config.get(CONFIG_KEY), dict) or config.get("architecture") == "voxcpm2"

    def load(self, folder: Path) -> tuple[VoxCPM2AudioVAEDecoder, Contract]:
        module, _ = load_folder(folder)
        return module, contract_of(module)

    def default(self, seed: int) -> tuple[VoxCPM2AudioVAEDecoder, Contract]:
        module = random_model(SHIPPED, seed=seed)
        return module, contract_of(module)

    def forward_stream(self, module: VoxCPM2AudioVAEDecoder, batch: StreamBatch,
                       state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        batch_size = batch.inputs.shape[0]
        hz = batch.options.get(SR_COND)  # [B] int64 on the device; absent: every row at the default
        buckets = module.sr_bucket(hz, batch_size)  # [B] long, torch.bucketize on the device
        return module.forward_stream(batch.inputs, batch.num_frames, state, batch.positions, buckets)  # [B, T * U]

    def forward(self, module: VoxCPM2AudioVAEDecoder, inputs: Tensor) -> Tensor:
        return module(inputs)  # [B, 1, T * U], sr_cond at its default

    def use_fused_kernels(self, module: VoxCPM2AudioVAEDecoder, enabled: bool) -> bool:
        return module.use_fused_kernels(enabled)  # Snake + the next conv (state concatenation; the last conv)


VOXCPM2_AUDIOVAE = VoxCPM2AudioVAEFamily()
