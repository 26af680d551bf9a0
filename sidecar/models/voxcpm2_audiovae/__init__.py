"""VoxCPM2's AudioVAE (V2) decoder: float latents [B, 64, T] at 25 Hz -> 48 kHz audio, exact streaming."""

from ..family import CheckpointError
from .config import SHIPPED, AudioVAEConfig
from .loader import (DEFAULT_SPEC, fold_decoder_state, is_family_folder, load_folder, load_state, random_model,
                     read_weights)
from .model import VoxCPM2AudioVAEDecoder

__all__ = ["AudioVAEConfig", "SHIPPED", "VoxCPM2AudioVAEDecoder", "CheckpointError", "DEFAULT_SPEC",
           "fold_decoder_state", "is_family_folder", "load_folder", "load_state", "random_model", "read_weights"]
