"""``VoxCPM2TalkerSidecar``: vLLM-Omni 0.30's VoxCPM2 talker with its AudioVAE decode in the code2wav sidecar.

Imported only when vLLM-Omni resolves the architecture (it subclasses the installed talker). Settings come from
the same environment variables as the Qwen3 delegate (``CODE2WAV_SIDECAR_ADDRESS``, ``..._MODEL``,
``..._TIMEOUT_S``, ``..._CONNECT_TIMEOUT_S``) plus ``CODE2WAV_SIDECAR_SR_COND`` (Hz; default: the model's 48000).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_omni.model_executor.models.voxcpm2.voxcpm2_talker import VoxCPM2TalkerForConditionalGeneration

from ..pool import SidecarPool
from ..vllm_omni.settings import DelegateSettings
from .latents import SidecarLatents
from .mixin import SidecarVAEMixin

log = logging.getLogger(__name__)


class VoxCPM2TalkerSidecar(SidecarVAEMixin, VoxCPM2TalkerForConditionalGeneration):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = DelegateSettings.from_sources({})
        sr_cond = os.environ.get("CODE2WAV_SIDECAR_SR_COND")
        client = SidecarPool(settings.address, client_id=f"vllm-omni-voxcpm2:{os.getpid()}",
                             **settings.client_options)
        self._sidecar = SidecarLatents(client, model=settings.model, sr_cond=int(sr_cond) if sr_cond else None)
        vae = self.tts.audio_vae
        if getattr(vae, "decoder", None) is not None:  # 45.8 M parameters the talker no longer runs
            vae.decoder = None
        log.info("VoxCPM2 AudioVAE decode delegated to the code2wav sidecar at %s", settings.address)
