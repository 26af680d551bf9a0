"""Offline decoding for the ``decode`` command: the inputs' checks, the decode (each row streamed through the
server's own stream modes and engine: exact, or window, vLLM-Omni's stateless chunked decode), WAV/NPY output."""

from __future__ import annotations

import os
import wave
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .engine import Engine
from .models import InputSpec, LoadedModel
from .modes import StreamMode
from .state_store import StateArena
from .streams import ServedStream


OUTPUT_SUFFIXES = (".npy", ".wav")
CODES_SHAPE = "[B, Q, T] or [Q, T] (batch, quantizers, frames)"
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
    """The inputs array of a ``.npy`` file (never unpickled): integer codes ``[B, Q, T]`` / ``[Q, T]``, or float32
    (float64) latents ``[B, D, T]`` / ``[D, T]``; one stream comes back as ``[1, C, T]``. The client's rules: float16
    latents are refused (the client refuses them too). Which kind the model takes: ``check_inputs``."""
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
    if inputs.dtype.kind == "f" and inputs.dtype.itemsize < 4:
        raise InputError(f"--input {path}: dtype {inputs.dtype} is not accepted (nor by the client): codes are "
                         "integers, latents float32 (float64 is converted); save them with .astype(np.float32)")
    if inputs.ndim == 2:
        inputs = inputs[None]  # [1, C, T]: one stream
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
def decode_offline(model: LoadedModel, inputs: Tensor, mode: StreamMode, chunk_frames: int,
                   left_context_frames: int, options: dict[str, int] | None = None) -> Tensor:
    """The ``decode`` command's decode: each row of ``inputs`` ``[B, C, T]`` streamed as the server would stream it
    in ``mode`` (the same ``StreamMode`` objects and engine), with ``options`` (checked stream options) for every
    row. A stateful mode (exact) carries the state between chunks, so its audio does not depend on the chunking:
    one chunk of all frames (the engine slices it to ``max_forward_frames``). A stateless mode (window) sends
    chunks of ``chunk_frames`` (>= 1), each decoded after the last ``left_context_frames`` (>= 0) inputs. Returns
    ``[B, 1, T * U]``."""
    if chunk_frames < 1 or left_context_frames < 0:
        raise ValueError(f"chunk_frames must be >= 1 and left_context_frames >= 0, got {chunk_frames} and "
                         f"{left_context_frames}")
    batch, _, total = inputs.shape
    arena = StateArena(model.state_layout(), batch, model.dtype, model.device)
    engine = Engine(model, arena)
    left = mode.left_context_frames(left_context_frames)
    streams = [ServedStream(client=b"offline", stream_id=str(b), model=model.name, mode=mode, left_context_frames=left,
                            slot=arena.allocate() if mode.stateful else None, last_active_s=0.0,
                            options=dict(options or {})) for b in range(batch)]
    step = total if mode.stateful else chunk_frames
    pieces = []
    for start in range(0, total, step):
        chunks = [inputs[b, :, start:start + step] for b in range(batch)]  # [C, n] each
        items = [mode.build_item(stream, chunk, 0) for stream, chunk in zip(streams, chunks)]
        pieces.append(torch.stack(engine.decode(items, mode=mode)))  # [B, n * U]
        for stream, chunk in zip(streams, chunks):
            mode.commit(stream, chunk)
    return torch.cat(pieces, dim=1)[:, None]  # [B, 1, T * U]


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
