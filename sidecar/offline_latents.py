"""Offline decoding of float latents (the ``decode`` command for a VoxCPM2 AudioVAE model): no server.

``latents.npy`` holds float ``[B, D, T]`` or ``[D, T]`` (one stream). The decode is exact: slices of at most
``max_forward_frames`` frames continue one another through the stream state, so memory stays bounded for long
inputs and the result equals the one-shot decode (up to float rounding).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .models.voxcpm2_audiovae import (DEFAULT_SPEC, SHIPPED, CheckpointError, VoxCPM2AudioVAEDecoder, is_family_folder, load_folder,
                                      random_model)
from .offline import save_audio

MAX_FORWARD_FRAMES = 250  # 10 s of audio per forward


def is_latents_model(spec: str) -> bool:
    """Whether ``--model`` names this family: its random-weights spec or a VoxCPM2 model folder."""
    return spec == DEFAULT_SPEC or (Path(spec).is_dir() and is_family_folder(spec))


def check_latents(latents: np.ndarray, latent_dim: int, source: str) -> np.ndarray:
    """``[B, D, T]`` float32 from a ``[B, D, T]`` or ``[D, T]`` float array; ValueError naming what is wrong."""
    if latents.dtype.kind != "f":
        raise ValueError(f"{source}: expected float latents, got {latents.dtype}")
    if latents.ndim == 2:
        latents = latents[None]
    if latents.ndim != 3 or latents.shape[1] != latent_dim:
        raise ValueError(f"{source}: expected latents [B, {latent_dim}, T] or [{latent_dim}, T] (channels first, "
                         f"frames last), got shape {list(latents.shape)}")
    if not np.isfinite(latents).all():
        raise ValueError(f"{source}: latents contain NaN or Inf")
    return latents.astype(np.float32)


@torch.inference_mode()
def decode_latents(model: VoxCPM2AudioVAEDecoder, latents: Tensor, sr_cond_hz: int | None = None,
                   max_forward_frames: int = MAX_FORWARD_FRAMES) -> Tensor:
    """``latents`` ``[B, D, T]`` -> float32 ``[B, 1, T * U]`` on CPU, in exact-streaming slices."""
    param = next(model.parameters())
    batch, _, num_frames = latents.shape
    buckets = model.sr_bucket(sr_cond_hz, batch)  # [B]
    state = model.zero_state(batch)
    pieces = []
    for start in range(0, num_frames, max_forward_frames):
        piece = latents[:, :, start:start + max_forward_frames].to(param.device)  # [B, D, n]
        wav, state = model.forward_stream(piece, None, state, None, buckets)  # [B, n * U]
        pieces.append(wav.cpu())
    if not pieces:
        return torch.zeros((batch, 1, 0))
    return torch.cat(pieces, dim=1)[:, None]  # [B, 1, T * U]


def cmd_decode_latents(args: argparse.Namespace) -> int:
    """``code2wav-sidecar decode --model FOLDER --input latents.npy --output out.wav [--sr-cond HZ]``."""
    from .models import DTYPES, resolve_device

    if args.mode != "exact":
        print("error: --mode window is not offered for latents: exact streaming is exact for this decoder",
              file=sys.stderr)
        return 2
    if args.model == DEFAULT_SPEC:
        model, sample_rate_hz = random_model(SHIPPED), SHIPPED.out_sample_rate
    else:
        try:
            model, sample_rate_hz = load_folder(args.model)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    model = model.to(device=resolve_device(args.device), dtype=DTYPES[args.dtype]).requires_grad_(False)
    try:
        latents = check_latents(np.load(args.input, allow_pickle=False), model.latent_dim, args.input)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.sr_cond is not None and args.sr_cond <= 0:
        print(f"error: --sr-cond {args.sr_cond}: give a sample rate in Hz, e.g. 16000 or 48000", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    wav = decode_latents(model, torch.from_numpy(latents), args.sr_cond)
    elapsed_s = time.perf_counter() - t0
    written = save_audio(Path(args.output), wav, sample_rate_hz)
    audio_s = wav.shape[0] * wav.shape[2] / sample_rate_hz
    sr_cond = args.sr_cond if args.sr_cond is not None else model.cfg.out_sample_rate
    print(f"decoded latents {tuple(latents.shape)} -> {tuple(wav.shape)} ({audio_s:.2f} s of audio at "
          f"{sample_rate_hz} Hz, sr_cond={sr_cond} Hz) into {', '.join(map(str, written))}")
    if args.time:
        print(f"decode time: {elapsed_s * 1e3:.1f} ms ({audio_s / elapsed_s:.1f}x real time)")
    return 0
