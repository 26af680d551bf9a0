"""``Qwen3TTSCode2WavSidecar``: a vLLM-Omni Code2Wav stage model that delegates decoding to the sidecar.

It holds no weights. Each runner step becomes one ``decode`` round trip (``delegate.Code2WavDelegate``), and the
waveforms come back in the Qwen3-TTS Code2Wav contract of vLLM-Omni 0.30::

    OmniOutput(text_hidden_states=None,
               multimodal_outputs={"model_outputs": [1-D float32 wav per request], "sr": [tensor(24000), ...]})

vLLM and vLLM-Omni are imported lazily (only ``OmniOutput``, at the first ``forward``), so the class is importable
and testable without them. Registered under ``ARCH_NAME`` by ``client.vllm_omni.register`` (an entry point of the
``vllm_omni.general_plugins`` group).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .delegate import Code2WavDelegate, cuda_stream_capturing
from .settings import DelegateSettings, connector_extra
from .step import dummy_runtime_information, parse_step

__all__ = ["ARCH_NAME", "Qwen3TTSCode2WavSidecar", "omni_output_type"]

log = logging.getLogger(__name__)

ARCH_NAME = "Qwen3TTSCode2WavSidecar"


def omni_output_type() -> Any:
    """vLLM-Omni's ``OmniOutput`` (a NamedTuple). Tests without vLLM-Omni replace this function."""
    from vllm_omni.model_executor.models.output_templates import OmniOutput

    return OmniOutput


def _checkpoint_decoder_config(model_path: str | None) -> dict[str, Any] | None:
    """``speech_tokenizer/config.json`` of a local checkpoint folder, if there is one (a hub id gives None)."""
    if not model_path:
        return None
    path = os.path.join(model_path, "speech_tokenizer", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


class Qwen3TTSCode2WavSidecar(nn.Module):
    """Drop-in for vLLM-Omni's ``Qwen3TTSCode2Wav`` stage model; the decoding happens in the sidecar."""

    input_modalities = "audio"
    # v1 passes scheduler ids as ``request_ids``; the v2 runner does not (then ``meta.request_id`` keys streams).
    requires_request_ids = True
    # A ``codes.audio`` payload is authoritative; the token ids may be placeholders.
    supports_native_payload_input = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        # Instance flags, as vLLM-Omni's Qwen3TTSCode2Wav sets them (so vLLM's class inspection sees the same).
        self.have_multimodal_outputs = True
        self.has_preprocess = False
        self.has_postprocess = False
        self.enable_update_additional_information = True
        self.requires_raw_input_tokens = True
        model_config = vllm_config.model_config
        extra = connector_extra(getattr(model_config, "stage_connector_config", None))
        self.settings = DelegateSettings.from_sources(extra)
        self.model_path = getattr(model_config, "model", None)
        client_id = f"vllm-omni-code2wav:{os.getpid()}"
        self.delegate = Code2WavDelegate(self.settings, client_id=client_id)  # raises a clear error if unreachable
        self._check_checkpoint()
        self._sr = torch.tensor(self.delegate.sample_rate, dtype=torch.int32)
        log.info("Code2Wav stage delegates to the code2wav sidecar at %s (model %s, mode %s, Q=%d, %d samples "
                 "per frame)", self.settings.address, self.delegate.model_name, self.settings.mode,
                 self.delegate.num_quantizers, self.delegate.samples_per_frame)

    def _check_checkpoint(self) -> None:
        cfg = _checkpoint_decoder_config(self.model_path)
        if cfg is None:
            return
        q = int((cfg.get("decoder_config") or {}).get("num_quantizers", self.delegate.num_quantizers))
        sr = int(cfg.get("output_sample_rate", self.delegate.sample_rate))
        if (q, sr) != (self.delegate.num_quantizers, self.delegate.sample_rate):
            self.delegate.close()
            raise ValueError(
                f"the checkpoint {self.model_path} has {q} quantizers at {sr} Hz but the code2wav sidecar at "
                f"{self.settings.address} serves {self.delegate.model_name} with {self.delegate.num_quantizers} "
                f"at {self.delegate.sample_rate} Hz: start the sidecar with --model {self.model_path}/speech_tokenizer")

    # ------------------------------------------------------------------ the runner's contract

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        """This stage ignores embeddings; a stable placeholder for the runner."""
        return torch.zeros((input_ids.shape[0], 1), device=input_ids.device, dtype=torch.float32)

    def compute_logits(self, hidden_states: Any, sampling_metadata: Any = None) -> None:
        return None

    def get_dummy_runtime_additional_information(self, num_reqs: int) -> list[dict[str, Any]]:
        """Marker requests for vLLM's dummy/profile runs: answered locally, never sent to the sidecar."""
        return dummy_runtime_information(num_reqs)

    def on_requests_finished(self, finished_req_ids: Any) -> None:
        self.delegate.on_requests_finished(finished_req_ids)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        runtime_additional_information: list[dict[str, Any]] | None = None,
        model_intermediate_buffer: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> Any:
        counts = kwargs.get("seq_token_counts")
        if cuda_stream_capturing():  # vLLM capturing a graph: touch neither the inputs nor the sidecar
            counts = counts or [input_ids.numel() if input_ids is not None else 0]
            wavs = [self.delegate.silence(int(c) // self.delegate.num_quantizers) for c in counts]
            return self.make_omni_output((wavs, [self._sr] * len(wavs)))
        infos = runtime_additional_information or model_intermediate_buffer or []
        requests = parse_step(input_ids, infos, counts, kwargs.get("request_ids"), self.delegate.num_quantizers)
        wavs = self.delegate.decode_step(requests)
        return self.make_omni_output((wavs, [self._sr] * len(wavs)))

    def make_omni_output(self, model_outputs: Any, **_: Any) -> Any:
        omni_output = omni_output_type()
        if isinstance(model_outputs, omni_output):
            return model_outputs
        if isinstance(model_outputs, tuple) and len(model_outputs) == len(omni_output._fields):
            return omni_output(*model_outputs)
        if not (isinstance(model_outputs, tuple) and len(model_outputs) == 2):
            raise TypeError(f"{ARCH_NAME}.make_omni_output expects OmniOutput or (wavs, srs), "
                            f"got {type(model_outputs)}")
        wavs, srs = model_outputs
        return omni_output(text_hidden_states=None, multimodal_outputs={"model_outputs": wavs, "sr": srs})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """No weights here (the sidecar loads the decoder); drain the iterator so the loader does not hang."""
        for _ in weights:
            pass
        return set()
