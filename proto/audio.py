"""How much audio a chunk returns: the one rule clients and the sidecar share.

Rules: sans-IO; stdlib only; imports nothing outside ``proto``.

A chunk of ``n`` frames whose first ``context_frames`` are context (decoded into the state, no audio) returns
``(n - context_frames) * samples_per_frame`` float32 samples; ``samples_per_frame`` (``U``) is the model's
(``welcome.models[i].samples_per_frame``).
"""

from __future__ import annotations

__all__ = ["audio_num_frames", "audio_num_samples"]


def audio_num_frames(num_frames: int, context_frames: int = 0) -> int:
    """Frames of a chunk that produce audio: all but its leading context frames."""
    return num_frames - context_frames


def audio_num_samples(num_frames: int, context_frames: int, samples_per_frame: int) -> int:
    """Samples of audio a chunk of ``num_frames`` frames returns, its first ``context_frames`` giving none."""
    return audio_num_frames(num_frames, context_frames) * samples_per_frame
