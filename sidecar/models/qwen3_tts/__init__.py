"""Qwen3-TTS 12 Hz codec decoder ("Code2Wav"), torch only, streaming-capable."""

from ..family import CheckpointError
from .config import SAMPLE_RATE_HZ, SHIPPED, DecoderConfig
from .decoder import Qwen3TTSDecoder
from .loader import load_folder, random_model

__all__ = ["DecoderConfig", "SHIPPED", "SAMPLE_RATE_HZ", "Qwen3TTSDecoder", "CheckpointError", "load_folder",
           "random_model"]
