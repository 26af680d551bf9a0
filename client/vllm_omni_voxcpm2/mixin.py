"""The overrides that move VoxCPM2's VAE decode out of the talker (no vLLM import; tested against 0.30's class).

In vLLM-Omni 0.30 every AudioVAE decode of the talker goes through ``_run_vae_decode``, called only from
``_collect_audio`` and ``_collect_audio_batch``, and ``_collect_audio`` is called only from
``_collect_audio_batch``: overriding that one method routes all of them (tests/test_voxcpm2_vllm_omni.py checks
this against the installed source). ``_cleanup_request`` is extended to drop the request's stream.
"""

from __future__ import annotations

from typing import Any

import torch

from .latents import LatentsBackend, take_new_latents


class SidecarVAEMixin:
    """Put before ``VoxCPM2TalkerForConditionalGeneration`` in the bases; set ``self._sidecar`` after init."""

    _sidecar: LatentsBackend

    def _collect_audio_batch(self, states: list[Any],
                             initial_delayed_chunks_by_req: dict[str, list[torch.Tensor] | None] | None = None
                             ) -> dict[str, torch.Tensor | None]:
        talker: Any = self
        outputs: dict[str, torch.Tensor | None] = {state.request_id: None for state in states}
        chunks: list[tuple[str, torch.Tensor, bool]] = []
        for state in states:
            latents = take_new_latents(state, talker._feat_dim, getattr(talker, "_vae_decode_every", 1),
                                       talker._should_stop_from_cached_logits)  # [n, D]
            if latents is not None:
                final = bool(talker._should_stop_from_cached_logits(state))
                chunks.append((state.request_id, latents.t().contiguous(), final))  # [D, n]: channels first
        audio = self._sidecar.decode(chunks) if chunks else []
        for (request_id, _, _), wav in zip(chunks, audio):
            outputs[request_id] = wav if getattr(talker, "_coalesce_audio_d2h", False) else wav.cpu().float()
        for request_id, delayed in (initial_delayed_chunks_by_req or {}).items():  # audio upstream had queued
            if delayed and request_id in outputs:
                parts = [c.reshape(-1).cpu().float() for c in delayed]
                if outputs[request_id] is not None:
                    parts.append(outputs[request_id].reshape(-1).cpu().float())
                outputs[request_id] = torch.cat(parts)
        return outputs

    def _cleanup_request(self, request_id: str) -> None:
        super()._cleanup_request(request_id)  # type: ignore[misc]
        self._sidecar.end(request_id)
