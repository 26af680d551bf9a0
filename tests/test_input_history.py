"""``client.history.InputHistory``: a pooled stream keeps exactly its last ``H`` committed frames (bounded memory,
in the narrow dtype), whatever the chunk sizes, and knows where they start in the stream (a replay's
``start_frame``)."""

from __future__ import annotations

import random

import numpy as np
import torch

from code2wav.client.history import InputHistory, host_inputs


def test_keeps_exactly_the_last_h_frames_for_any_chunking():
    rng = random.Random(48)
    codes = torch.randint(0, 2048, (16, 700))  # [Q, T]
    for history_frames in (0, 1, 25, 580):
        for _ in range(20):
            kept = InputHistory(history_frames)
            start = 0
            while start < codes.shape[1]:
                end = min(codes.shape[1], start + rng.choice([0, 1, 4, 25, 100, 600]))
                kept.add(host_inputs(codes[:, start:end], "codes", 2048)[0])
                start = end
                expected = codes[:, max(0, start - history_frames):start]
                assert kept.num_frames == expected.shape[1] and kept.total_frames == start
                assert kept.first_frame == start - expected.shape[1]
                frames = kept.frames()
                assert (frames is None) == (expected.shape[1] == 0)
                if frames is not None:
                    assert torch.equal(frames.long(), expected)
                    assert kept.nbytes == expected.numel() * 2  # codes of a 2048-entry codebook: int16


def test_memory_per_stream_of_the_shipped_models():
    qwen3 = InputHistory(580)  # welcome's history_frames for Qwen3-TTS 12 Hz
    qwen3.add(host_inputs(np.zeros((16, 1000), dtype=np.int64), "codes", 2048)[0])
    assert qwen3.nbytes == 580 * 16 * 2 == 18_560
    voxcpm2 = InputHistory(20)  # VoxCPM2's AudioVAE
    voxcpm2.add(host_inputs(torch.randn(64, 4, dtype=torch.float64), "latents", None)[0])
    voxcpm2.add(host_inputs(torch.randn(64, 30), "latents", None)[0])
    assert voxcpm2.frames().dtype == torch.float32 and voxcpm2.nbytes == 20 * 64 * 4 == 5_120
    window = InputHistory(25)  # a window stream keeps its left context
    window.add(host_inputs(torch.zeros(16, 25, dtype=torch.long), "codes", 2048)[0])
    assert window.nbytes == 25 * 16 * 2
