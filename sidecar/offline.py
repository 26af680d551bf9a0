"""Offline decoding for the ``decode`` command: exact (one forward over all frames) or window (vLLM-Omni's
stateless chunked decode), plus WAV/NPY output. Uses the same Engine code path as the server."""

from __future__ import annotations

import os
import wave
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .engine import Engine
from .models import InputSpec


OUTPUT_SUFFIXES = (".npy", ".wav")
CODES_SHAPE = "[B, Q, T] (batch, quantizers, frames)"
LATENTS_SHAPE = "[B, D, T] or [D, T] (batch, latent channels, frames)"


class InputError(ValueError):
    """A ``decode`` input or output the person has to fix; the message is one line naming what is expected."""


def check_output_path(path: Path) -> Path:
    """Refuse, before any decoding, an output that cannot be written: wrong suffix, missing or read-only folder."""
    if path.suffix not in OUTPUT_SUFFIXES:
        raise InputError(f"--output {path}: use a .npy (float32 [B, 1, T*U]) or .wav file name")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"--output {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"--output {path}: the folder {folder} is not writable")
    if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"--output {path}: exists and cannot be overwritten")
    return path


def load_inputs_npy(path: Path) -> np.ndarray:
    """The inputs array of a ``.npy`` file (never unpickled): integer codes ``[B, Q, T]``, or float latents
    ``[B, D, T]`` / ``[D, T]`` (one stream, returned as ``[1, D, T]``). Which kind the model takes: ``check_inputs``."""
    expected = f"expected integer codes {CODES_SHAPE} or float latents {LATENTS_SHAPE} in a .npy file"
    if not path.is_file():
        raise InputError(f"--input {path}: no such file ({expected})")
    try:
        inputs = np.load(path, allow_pickle=False)
    except PermissionError:
        raise InputError(f"--input {path}: not readable (permission denied)") from None
    except (OSError, ValueError, EOFError) as exc:  # not .npy, truncated, or an object array (pickle)
        raise InputError(f"--input {path}: not a readable .npy array ({exc}); {expected}") from None
    if not isinstance(inputs, np.ndarray):
        raise InputError(f"--input {path}: holds {type(inputs).__name__}, not an array; {expected}")
    if inputs.dtype.kind not in "iuf":
        raise InputError(f"--input {path}: dtype {inputs.dtype}; {expected}")
    if inputs.dtype.kind == "f" and inputs.ndim == 2:
        inputs = inputs[None]  # [1, D, T]
    if inputs.ndim != 3:
        raise InputError(f"--input {path}: shape {list(inputs.shape)}; {expected}")
    return inputs


def check_inputs(inputs: np.ndarray, source: str, spec: InputSpec) -> Tensor:
    """``inputs`` against the model's input spec (kind, channels, values); returns them as a host tensor
    ``[B, C, T]`` (int64 codes or float32 latents)."""
    if spec.is_integer != (inputs.dtype.kind in "iu"):
        what = f"integer codes {CODES_SHAPE}" if spec.is_integer else f"float latents {LATENTS_SHAPE}"
        raise InputError(f"--input {source}: dtype {inputs.dtype}; expected {what} for this model")
    if spec.is_integer:
        check_codes(inputs, source, spec.channels, spec.high)
        return torch.from_numpy(inputs.astype(np.int64))  # [B, Q, T]
    batch, channels, num_frames = inputs.shape
    if channels != spec.channels or batch < 1 or num_frames < 1:
        raise InputError(f"--input {source}: shape {list(inputs.shape)}; expected latents [B, {spec.channels}, T] "
                         f"or [{spec.channels}, T] (channels first, frames last) with B, T >= 1")
    latents = torch.from_numpy(inputs.astype(np.float32))  # [B, D, T]
    problem = spec.problem(latents)
    if problem is not None:
        raise InputError(f"--input {source}: {problem}")
    return latents


def check_codes(codes: np.ndarray, source: str, num_quantizers: int, codebook_size: int) -> None:
    """Shape and value range against the model: ``[B, num_quantizers, T]``, ``T >= 1``, values in
    ``[0, codebook_size)``."""
    batch, quantizers, num_frames = codes.shape
    expected = f"expected [B, {num_quantizers}, T] with B, T >= 1 and values in [0, {codebook_size})"
    if quantizers != num_quantizers or batch < 1 or num_frames < 1:
        raise InputError(f"--input {source}: shape {list(codes.shape)}; {expected}")
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= codebook_size:
        raise InputError(f"--input {source}: values span [{low}, {high}]; {expected}")


@torch.inference_mode()
def decode_exact(engine: Engine, codes: Tensor, options: dict[str, int] | None = None) -> Tensor:
    """``codes`` ``[B, Q, T]`` -> ``[B, 1, T * U]``: the one-shot decode (exact slices of ``max_forward_frames``)."""
    batch, _, num_frames = codes.shape
    device = engine.device
    lengths = torch.full((batch,), num_frames, dtype=torch.long, device=device)
    positions = torch.zeros(batch, dtype=torch.long, device=device)
    rows = _rows_options(options, batch, device)
    wav, _, _ = engine.run(codes.to(device), lengths, engine.model.zero_state(batch), positions, rows)
    return wav.cpu()[:, None]


@torch.inference_mode()
def decode_window(engine: Engine, codes: Tensor, chunk_frames: int, left_context_frames: int,
                  options: dict[str, int] | None = None) -> Tensor:
    """Stateless chunked decode: frames ``[s, e)`` come from decoding ``codes[s - c : e]`` with
    ``c = min(left_context_frames, s)`` and dropping the first ``c * U`` samples."""
    batch, _, num_frames = codes.shape
    spf = engine.model.samples_per_frame
    device = engine.device
    rows = _rows_options(options, batch, device)
    pieces = []
    for start in range(0, num_frames, chunk_frames):
        end = min(start + chunk_frames, num_frames)
        ctx = min(left_context_frames, start)
        window = codes[:, :, start - ctx: end].to(device)  # [B, Q, c + n]
        lengths = torch.full((batch,), end - start + ctx, dtype=torch.long, device=device)
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        wav, _, _ = engine.run(window, lengths, engine.model.zero_state(batch), positions, rows)  # [B, (c + n) * U]
        pieces.append(wav[:, ctx * spf:].cpu())
    return torch.cat(pieces, dim=1)[:, None]  # [B, 1, T * U]


def _rows_options(options: dict[str, int] | None, batch: int, device: torch.device) -> dict[str, Tensor]:
    """Checked stream options (``Contract.check_options``), the same for every row: name -> ``[B]``."""
    return {name: torch.full((batch,), value, dtype=torch.long, device=device)
            for name, value in (options or {}).items()}


def decode_offline(engine: Engine, inputs: Tensor, mode: str, chunk_frames: int, left_context_frames: int,
                   options: dict[str, int] | None = None) -> Tensor:
    """The ``decode`` command's one call: ``exact`` (one-shot) or ``window`` (chunked) by name; ``options``: the
    model's stream options (every row the same)."""
    decoders = {"exact": lambda: decode_exact(engine, inputs, options),
                "window": lambda: decode_window(engine, inputs, chunk_frames, left_context_frames, options)}
    if mode not in decoders:
        raise ValueError(f"offline mode must be one of {sorted(decoders)}, got {mode!r}")
    return decoders[mode]()


def write_wav(path: Path, audio: np.ndarray, sample_rate_hz: int) -> None:
    """Mono 16-bit PCM WAV of float samples in [-1, 1]."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate_hz)
        f.writeframes(pcm.tobytes())


def save_audio(path: Path, wav: Tensor, sample_rate_hz: int) -> list[Path]:
    """``wav`` ``[B, 1, S]`` to ``.npy`` (as is) or ``.wav`` (one file per row when B > 1)."""
    if path.suffix == ".npy":
        np.save(path, wav.numpy().astype(np.float32))
        return [path]
    if path.suffix != ".wav":
        raise ValueError(f"--output {path}: use a .npy or .wav file name")
    if wav.shape[0] == 1:
        write_wav(path, wav[0, 0].numpy(), sample_rate_hz)
        return [path]
    written = []
    for b in range(wav.shape[0]):
        row_path = path.with_name(f"{path.stem}-{b}{path.suffix}")
        write_wav(row_path, wav[b, 0].numpy(), sample_rate_hz)
        written.append(row_path)
    return written
