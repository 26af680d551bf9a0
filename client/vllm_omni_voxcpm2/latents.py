"""Where the talker's latents go: per request, one exact sidecar stream (no vLLM import here).

``take_new_latents`` is vLLM-Omni 0.30's rule for when a VoxCPM2 request has latents to decode (its
``_collect_audio``): the newest patch ``[patch_size, D]`` as float32 frames, gathered ``vae_decode_every`` patches
at a time unless the request is stopping. ``SidecarLatents`` sends them, all requests of a step in one ``decode``
message, each request on its own exact stream (the sidecar keeps the VAE's state, so the audio equals one
decode of all the request's latents; upstream's own path re-decodes 12 frames of left context each step).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class LatentsBackend(Protocol):
    def decode(self, chunks: list[tuple[str, Tensor, bool]]) -> list[Tensor]:
        """``(request_id, latents [D, n], final)`` per request -> audio ``[n * U]`` per request, in order."""
        ...

    def end(self, request_id: str) -> None:
        """The request is gone: drop its stream (abort it if it was not finished)."""
        ...


def take_new_latents(state: Any, feat_dim: int, vae_decode_every: int,
                     is_stopping: Callable[[Any], bool]) -> Tensor | None:
    """The request's latents due for decoding now, ``[n, D]`` float32 (frames first, as upstream), or None."""
    patch = state.last_audio_patch_gpu
    if patch is None:
        return None
    state.last_audio_patch_gpu = None
    new_latent = patch.reshape(-1, feat_dim).to(torch.float32)  # [patch_size, D]
    if vae_decode_every > 1:
        stopping = is_stopping(state)
        state.pending_vae_latents_gpu.append(new_latent.detach())
        if not stopping and len(state.pending_vae_latents_gpu) < vae_decode_every:
            return None
        new_latent = torch.cat(state.pending_vae_latents_gpu, dim=0)  # [k * patch_size, D]
        state.pending_vae_latents_gpu.clear()
    return new_latent


class SidecarLatents:
    """One exact stream per request on a ``SidecarClient``; every step's chunks go in one ``decode_batch``."""

    def __init__(self, client: Any, *, model: str | None = None, sr_cond: int | None = None,
                 stream_prefix: str = "voxcpm2") -> None:
        self.client = client
        self.model = model
        self.sr_cond = sr_cond
        self.stream_prefix = stream_prefix
        self._streams: dict[str, Any] = {}

    def _stream(self, request_id: str) -> Any:
        stream = self._streams.get(request_id)
        if stream is None:
            options = {} if self.sr_cond is None else {"sr_cond": self.sr_cond}
            stream = self.client.open_stream(f"{self.stream_prefix}:{request_id}", model=self.model,
                                             options=options)
            self._streams[request_id] = stream
        return stream

    def decode(self, chunks: list[tuple[str, Tensor, bool]]) -> list[Tensor]:
        items = [(self._stream(rid), latents, {"final": final}) for rid, latents, final in chunks]
        audio = self.client.decode_batch(items)
        for rid, _, final in chunks:
            if final:
                self._streams.pop(rid, None)  # the sidecar closed it with its final chunk
        return audio

    def end(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        try:
            stream.abort()
        except Exception as exc:  # the request is gone either way; the sidecar reaps idle streams by TTL
            log.warning("code2wav-sidecar: could not abort stream of request %s: %s", request_id, exc)
