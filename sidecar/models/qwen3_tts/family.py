"""The Qwen3-TTS 12 Hz codec decoder as a ``DecoderFamily``: integer codes ``[B, Q, T]`` in ``[0, K)``, 24 kHz."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import Tensor

from ..family import Contract, GraphBuckets, InputSpec, StreamBatch, state_specs
from .config import SAMPLE_RATE_HZ, SHIPPED
from .decoder import Qwen3TTSDecoder
from .loader import load_folder, random_model


# vLLM-Omni's Code2Wav stage sends a 1-frame first chunk, then 25-frame chunks (its shipped deploy file); window
# mode sees 25 new frames with 25 of left context. Exact batches stop at 16: b32 and b64 fit the default 2 GiB
# graph budget only in time slices (the step's live peak is about 55 MiB per row of 25 frames), and on the H200
# (bf16) a sliced step costs more per row than b16 whole (the sidecar's mean step per row: b32 in 3 slices 1.79 ms,
# b64 in 7 slices 1.33 ms, b16 whole 1.07 ms), while the batch's latency grows: docs/performance.md, "One block per
# captured step, and no batching window when nobody can join".
GRAPH_BUCKETS = GraphBuckets(exact_batch_sizes=(1, 2, 4, 8, 16), exact_frames=(1, 25),
                             window_batch_sizes=(1, 2, 4, 8), window_frames=(50,))


def contract_of(module: Qwen3TTSDecoder, sample_rate_hz: int) -> Contract:
    cfg = module.cfg
    return Contract(input=InputSpec("codes", cfg.num_quantizers, cfg.codebook_size), sample_rate_hz=sample_rate_hz,
                    samples_per_frame=cfg.samples_per_frame,
                    state=state_specs(module.state_layout()), history_frames=cfg.history_frames)


class Qwen3TTSFamily:
    name = "qwen3_tts"
    default_model_name = "qwen3-tts-12hz"
    graph_buckets = GRAPH_BUCKETS

    def recognises(self, config: Mapping[str, Any]) -> bool:
        """A ``speech_tokenizer/config.json``: a ``decoder_config`` object (its fields are checked at load)."""
        return isinstance(config.get("decoder_config"), dict)

    def load(self, folder: Path) -> tuple[Qwen3TTSDecoder, Contract]:
        module, sample_rate_hz = load_folder(folder)
        return module, contract_of(module, sample_rate_hz)

    def default(self, seed: int) -> tuple[Qwen3TTSDecoder, Contract]:
        module = random_model(SHIPPED, seed=seed)
        return module, contract_of(module, SAMPLE_RATE_HZ)

    def forward_stream(self, module: Qwen3TTSDecoder, batch: StreamBatch,
                       state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        tail = None if batch.audio else module.cfg.tail_frames  # a replay: the convolutions over their reach only
        return module.forward_stream(batch.inputs, batch.num_frames, state, batch.positions, tail)  # [B, T' * U]

    def forward(self, module: Qwen3TTSDecoder, inputs: Tensor) -> Tensor:
        return module(inputs)  # [B, 1, T * U]

    def use_fused_kernels(self, module: Qwen3TTSDecoder, enabled: bool) -> bool:
        return module.use_fused_kernels(enabled)  # SnakeBeta + the next conv (state concatenation; the last conv)


QWEN3_TTS = Qwen3TTSFamily()
