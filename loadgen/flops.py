"""The compute ceiling the bench reports against: FLOPs per audio-second of the loaded model, counted here, and the
device's peak FLOP/s for the run's dtype.

- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over one exact ``forward_stream`` call (2 rows x 25 frames,
  zero state) on the bench's own device and dtype. It counts matmuls and convolutions (transposed ones too), not
  elementwise work, so the ceiling is the tensor-math bound: 62 GFLOP per audio-second for the Qwen3-TTS 12 Hz
  decoder, about 18 for VoxCPM2's AudioVAE decoder.
- Peak: ``--peak-tflops`` when given; else a known GPU's figure for the dtype (``PEAK_FLOPS``), else none (no
  fraction printed). The H100/H200 bf16 figure is the one issue 21 states its ceiling with (about 12,700
  audio-s/s x 62 GFLOP = 790 TFLOP/s), below NVIDIA's 989 dense-bf16 datasheet value; the float32 one is the
  non-tensor FP32 rate (the server runs float32 with TF32 off).

``ceiling fraction = audio-s/s x FLOPs per audio-second / peak FLOP/s`` (``report.ceiling_fraction``).
"""

from __future__ import annotations

import torch

from code2wav.sidecar.models import StreamBatch

from .inputs import InputContract, synthetic_batch

PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("H200", "bfloat16"): 790e12, ("H200", "float16"): 790e12, ("H200", "float32"): 67e12,
    ("H100", "bfloat16"): 790e12, ("H100", "float16"): 790e12, ("H100", "float32"): 67e12,
}
"""(substring of the GPU's name, dtype) -> assumed peak FLOP/s; see the module docstring."""

FLOP_COUNT_ROWS, FLOP_COUNT_FRAMES = 2, 25


def flops_per_audio_s(model) -> float:
    """Matmul and convolution FLOPs of one exact step per second of audio it decodes (``model``: a loaded model)."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    rows, frames = FLOP_COUNT_ROWS, FLOP_COUNT_FRAMES
    inputs = synthetic_batch(InputContract.of(model), rows, frames, seed=0).to(model.device)  # [B, C, T]
    num_frames = torch.full((rows,), frames, device=model.device)
    positions = torch.zeros(rows, dtype=torch.long, device=model.device)
    batch = StreamBatch(inputs.to(model.input.staged_dtype(model.dtype)), num_frames, positions,
                        model.zero_options(rows))
    with torch.inference_mode():
        # once uncounted first: a layer that measures its formulations on a new shape (kernels/conv_choice.py) does
        # it then, so the counted call is the step as it runs
        model.forward_stream(batch, model.module.zero_state(rows))
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model.forward_stream(batch, model.module.zero_state(rows))
    audio_s = rows * frames * model.samples_per_frame / model.sample_rate_hz
    return counter.get_total_flops() / audio_s


def peak_flops(gpu_name: str | None, dtype: str, peak_tflops: float | None = None) -> tuple[float | None, str]:
    """``(peak FLOP/s or None, where it comes from)`` for the run's device and dtype."""
    if peak_tflops:
        return peak_tflops * 1e12, "--peak-tflops"
    for (name, table_dtype), value in PEAK_FLOPS.items():
        if gpu_name and name in gpu_name and table_dtype == dtype:
            return value, f"assumed for {name} {dtype} (loadgen/flops.py)"
    return None, f"unknown for {gpu_name or 'this device'} {dtype}: pass --peak-tflops"


def compute_summary(model, gpu_name: str | None, dtype: str, peak_tflops: float | None = None) -> dict:
    """The report's ``compute`` entry: counted FLOPs per audio-second, the peak and the ceiling in audio-s/s."""
    per_audio_s = flops_per_audio_s(model)
    peak, source = peak_flops(gpu_name, dtype, peak_tflops)
    return {"flops_per_audio_s": round(per_audio_s), "peak_flops": peak, "peak_source": source,
            "ceiling_audio_s_per_s": round(peak / per_audio_s, 1) if peak and per_audio_s else None}
