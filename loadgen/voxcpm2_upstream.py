"""The bench's ``voxcpm2-upstream`` step: upstream VoxCPM2's own AudioVAE V2 module (``voxcpm==2.0.3``, file
``voxcpm/modules/audiovae/audio_vae_v2.py``) timed in-process on the same device, dtype, config and weights as
the VoxCPM2 model under test, in the same run.

The file is loaded on its own (``importlib.util.spec_from_file_location`` under a private module name): ``import
voxcpm`` would run the package's ``__init__``, which pulls transformers, gradio and more; the file itself needs
only math, typing, numpy, torch and pydantic, so ``pip install --no-deps voxcpm==2.0.3`` is enough. Its
``AudioVAE`` is built from our loaded model's config and given OUR folded decoder weights: for each weight-normed
conv, ``weight_v`` = our weight and ``weight_g`` = its norm over every dim but 0, so upstream's ``g * v / ||v||``
gives our weight back; everything else is copied by name. The encoder keeps random weights (never run).

Rows (same fields as ``baselines.BaselineResult``):

- ``voxcpm2-upstream-stream-b1-t4``: ``with vae.streaming_decode() as dec`` fed fresh streams in 4-frame patches
  (one VoxCPM2 LM patch, 160 ms of audio), each patch timed; first patches included (their p50 also on its own);
- ``voxcpm2-upstream-oneshot-b64-t25``: ``vae.decode(z)`` of 64 x 25 frames;
- ``voxcpm2-upstream-compiled-oneshot-b64-t25`` (``--upstream-compile``): the same through ``torch.compile``.

Plus a cross-check: upstream one-shot and streaming against our ``forward`` on the same latents (max abs diff, SNR).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .timing import baseline_row, print_row, sync_device, time_calls

NAME = "voxcpm2-upstream"
DISTRIBUTION = "voxcpm"
VERSION = "2.0.3"
MODULE_FILE = "voxcpm/modules/audiovae/audio_vae_v2.py"
PIP_HINT = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"
PRIVATE_NAME = "_code2wav_upstream_voxcpm_audio_vae_v2"  # never ``voxcpm.*``: the package itself is not imported
STREAM_FRAMES = 4  # one VoxCPM2 LM patch
STREAM_PATCHES = 10  # patches per timed stream (40 frames: past the decoder's 20-frame history)
MIN_STREAMS = 5
ONESHOT_BATCH, ONESHOT_FRAMES = 64, 25
WARMUP = 3


class UpstreamUnavailable(RuntimeError):
    """voxcpm is not installed (or its file is missing); the message has the pip command."""


class UpstreamWeightError(ValueError):
    """Our decoder's weights do not cover upstream's decoder (names or shapes); the message lists them."""


def add_upstream_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("voxcpm2-upstream baseline (VoxCPM2's own AudioVAE V2 module, latents models)")
    g.add_argument("--upstream", default="auto", choices=["auto", "none"],
                   help=f"auto: measure {NAME} for a VoxCPM2 model when voxcpm is installed ({PIP_HINT})")
    g.add_argument("--upstream-compile", action="store_true",
                   help="also time torch.compile (default mode) of upstream's one-shot decode")


def module_path() -> Path:
    """The installed distribution's ``audio_vae_v2.py``, found without importing the ``voxcpm`` package."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise UpstreamUnavailable(f"voxcpm is not installed ({PIP_HINT}; --no-deps: only one file of it is used, "
                                  f"and it needs nothing beyond torch, numpy and pydantic)") from exc
    path = Path(str(dist.locate_file(MODULE_FILE)))
    if not path.is_file():
        raise UpstreamUnavailable(f"voxcpm {dist.version} has no {MODULE_FILE} ({PIP_HINT})")
    return path


def load_upstream_module() -> ModuleType:
    """Execute upstream's file as the private module ``PRIVATE_NAME`` (registered, so pydantic and torch.jit can
    resolve its names; loaded once per process)."""
    if PRIVATE_NAME in sys.modules:
        return sys.modules[PRIVATE_NAME]
    path = module_path()
    spec = importlib.util.spec_from_file_location(PRIVATE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_NAME] = module
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*torch.jit.script.*")
            spec.loader.exec_module(module)  # its snake() is @torch.jit.script, deprecated in torch 2.13
    except BaseException:
        del sys.modules[PRIVATE_NAME]
        raise
    return module


def _norm_except_dim0(weight: Tensor) -> Tensor:
    """``||w||`` over every dim but 0, ``[N]`` (weight_norm's ``g`` for dim=0, Conv1d and ConvTranspose1d)."""
    return weight.flatten(1).norm(dim=1)  # [N]


def copy_decoder_weights(vae: torch.nn.Module, ours: dict[str, Tensor]) -> None:
    """Load our folded ``decoder.*`` tensors (checkpoint names: ``VoxCPM2AudioVAEDecoder.checkpoint_state_dict()``)
    into upstream's weight-normed decoder, in place. Every upstream
    decoder tensor must get a source of its shape, and every one of ours must be used: else ``UpstreamWeightError``."""
    target = {k: v for k, v in vae.state_dict().items() if k.startswith("decoder.")}
    missing, mismatched, used = [], [], set()
    for key, dest in target.items():
        is_norm = key.endswith(("weight_g", "weight_v"))
        source_key = key[:-2] if is_norm else key  # "...weight_v" / "...weight_g" -> our folded "...weight"
        source = ours.get(source_key)
        if source is None:
            missing.append(key)
            continue
        used.add(source_key)
        source = source.detach().to(torch.float32)
        value = source
        if key.endswith("weight_g") and source.shape[0] == dest.shape[0]:
            value = _norm_except_dim0(source).reshape(dest.shape)  # [N, 1, 1]: g * v / ||v|| == our weight
        if value.shape != dest.shape:
            mismatched.append(f"{key}: upstream {tuple(dest.shape)} vs ours {source_key} {tuple(source.shape)}")
            continue
        with torch.no_grad():
            dest.copy_(value)
    unused = sorted(k for k in ours if k.startswith("decoder.") and k not in used)
    problems = ([f"upstream decoder tensors with no source in our model: {missing}"] if missing else []) + \
        ([f"shapes differ: {mismatched}"] if mismatched else []) + \
        ([f"our tensors upstream has no place for: {unused}"] if unused else [])
    if problems:
        raise UpstreamWeightError("cannot give upstream's AudioVAE our decoder weights (is the config the same?): "
                                  + "; ".join(problems))


def upstream_vae(cfg) -> torch.nn.Module:
    """Upstream's ``AudioVAE(AudioVAEConfig(**fields))`` for our ``AudioVAEConfig``, with its own random init
    (float32, CPU)."""
    upstream = load_upstream_module()
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.model_dump().items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*weight_norm.*")
        return upstream.AudioVAE(upstream.AudioVAEConfig(**fields))


def build_upstream(our_module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Upstream's ``AudioVAE`` with our module's config (``our_module.cfg``) and weights, on device/dtype, eval."""
    vae = upstream_vae(our_module.cfg)
    copy_decoder_weights(vae, our_module.checkpoint_state_dict())  # in float32, before the cast
    return vae.to(device=device, dtype=dtype).eval()


def _latents(batch: int, channels: int, num_frames: int, device: torch.device, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((batch, channels, num_frames), generator=gen).to(device=device, dtype=dtype)  # [B, D, T]


def stream_decode(vae, latents: Tensor, patch_frames: int, device: torch.device) -> tuple[Tensor, list[float]]:
    """One fresh upstream stream over ``latents`` ``[B, D, T]`` in ``patch_frames`` patches: audio ``[B, 1, T*U]``
    and each patch's seconds (synchronized)."""
    outs, times = [], []
    with vae.streaming_decode() as dec:
        for start in range(0, latents.shape[2], patch_frames):
            t0 = time.perf_counter()
            outs.append(dec.decode_chunk(latents[:, :, start:start + patch_frames]))  # [B, 1, n * U]
            sync_device(device)
            times.append(time.perf_counter() - t0)
    return torch.cat(outs, dim=2), times  # [B, 1, T * U]


def _compare(ours: Tensor, theirs: Tensor) -> dict:
    ours, theirs = ours.float(), theirs.float()
    err = (ours - theirs).pow(2).sum().item()
    snr = None if err == 0 else round(10 * math.log10(max(ours.pow(2).sum().item(), 1e-30) / err), 2)
    return {"max_abs_diff": float((ours - theirs).abs().max().item()), "snr_db": snr}


def cross_check(vae, model, latents: Tensor) -> dict:
    """Upstream one-shot and 4-frame streaming vs our ``forward`` on the same latents ``[B, D, T]``."""
    ours = model.module(latents)  # [B, 1, T * U] float32
    theirs = vae.decode(latents)  # [B, 1, T * U]
    streamed, _ = stream_decode(vae, latents, STREAM_FRAMES, model.device)
    return {"batch": latents.shape[0], "frames": latents.shape[2], "oneshot": _compare(ours, theirs),
            "stream_t4": _compare(ours, streamed)}


def run_upstream(model, iters: int, compile_oneshot: bool = False, say=print) -> dict:
    """Build and time upstream's module (module doc); returns ``{"rows": [...], ...}``. Raises
    ``UpstreamUnavailable`` without voxcpm, ``UpstreamWeightError`` when our weights do not fit it."""
    device, dtype = model.device, model.dtype
    t0 = time.perf_counter()
    vae = build_upstream(model.module, device, dtype)
    info = {"voxcpm": importlib.metadata.version(DISTRIBUTION), "module": MODULE_FILE, "dtype": str(dtype),
            "build_s": round(time.perf_counter() - t0, 3)}
    channels = model.num_channels
    rows = []
    with torch.no_grad():
        info["cross_check"] = cross_check(vae, model, _latents(2, channels, 2 * ONESHOT_FRAMES, device, dtype, 11))
        streams = max(MIN_STREAMS, math.ceil(iters / STREAM_PATCHES))
        latents = _latents(1, channels, STREAM_FRAMES * STREAM_PATCHES, device, dtype, 12)  # [1, D, 40]
        stream_decode(vae, latents, STREAM_FRAMES, device)  # warm-up stream
        all_times, first_times = [], []
        for _ in range(streams):
            _, times = stream_decode(vae, latents, STREAM_FRAMES, device)
            all_times += times
            first_times.append(times[0])
        rows.append(baseline_row(f"{NAME}-stream-b1-t{STREAM_FRAMES}", 1, STREAM_FRAMES, all_times, model))
        info["stream"] = {"streams": streams, "patches_per_stream": STREAM_PATCHES,
                          "first_patch_ms_p50": round(statistics.median(first_times) * 1e3, 3),
                          "first_patch_ms_max": round(max(first_times) * 1e3, 3)}
        z = _latents(ONESHOT_BATCH, channels, ONESHOT_FRAMES, device, dtype, 13)  # [64, D, 25]
        times = time_calls(lambda: vae.decode(z), device, iters, WARMUP)
        rows.append(baseline_row(f"{NAME}-oneshot-b{ONESHOT_BATCH}-t{ONESHOT_FRAMES}", ONESHOT_BATCH, ONESHOT_FRAMES,
                                 times, model))
        if compile_oneshot:
            say(f"{NAME}: torch.compile of upstream's one-shot decode (default mode); the warm-up compiles ...")
            compiled = torch.compile(vae.decode)
            t0 = time.perf_counter()
            compiled(z)
            sync_device(device)
            info["compile_s"] = round(time.perf_counter() - t0, 2)
            times = time_calls(lambda: compiled(z), device, iters, WARMUP)
            rows.append(baseline_row(f"{NAME}-compiled-oneshot-b{ONESHOT_BATCH}-t{ONESHOT_FRAMES}", ONESHOT_BATCH,
                                     ONESHOT_FRAMES, times, model))
    return {"rows": rows, **info}


def _ours(rows: list[dict], batch: int, new_frames: int) -> list[dict]:
    """Our exact row at (batch, frames) to compare: the graph one, else the eager one."""
    for prefix in ("exact-graph-", "exact-eager-"):
        found = [r for r in rows if r["name"].startswith(prefix) and r["batch"] == batch
                 and r["new_frames"] == new_frames]
        if found:
            return found[:1]
    return []


def ratios(ours_rows: list[dict], upstream_rows: list[dict]) -> dict:
    """Ours vs upstream: per-patch latency at b1 x 4 (upstream / ours: > 1 means ours is faster) and audio-s/s at
    b64 x 25 (ours / upstream), for every upstream row with a matching row of ours."""
    out = {}
    for up in upstream_rows:
        for ours in _ours(ours_rows, up["batch"], up["new_frames"]):
            _ratio(out, ours, up)
    return out


def _ratio(out: dict, ours: dict, up: dict) -> None:
    if up["batch"] == 1:
        out[f"{ours['name']} vs {up['name']}: p50 latency, upstream/ours"] = round(
            up["latency_ms_p50"] / ours["latency_ms_p50"], 2)
    else:
        out[f"{ours['name']} vs {up['name']}: audio-s/s, ours/upstream"] = round(
            ours["audio_s_per_s"] / up["audio_s_per_s"], 2)


def run_upstream_step(args: argparse.Namespace, model, ours_rows: list[dict]) -> dict:
    """The bench step: ``{"rows": ..., "ratios": ..., ...}`` or ``{"skipped": reason}`` (printed either way)."""
    if getattr(args, "upstream", "auto") == "none" or getattr(args, "no_baselines", False):
        return {"skipped": "not asked for"}
    if model.input.is_integer:
        reason = (f"model {model.name} decodes {model.input.kind}; the {NAME} baseline is VoxCPM2's AudioVAE, "
                  "for latents models only")
        return {"skipped": reason}
    print(f"\n{NAME}: building VoxCPM2's own AudioVAE V2 ({MODULE_FILE}) with this model's config and weights ...",
          flush=True)
    try:
        result = run_upstream(model, args.baseline_iters, compile_oneshot=args.upstream_compile,
                              say=lambda text: print(text, file=sys.stderr, flush=True))
    except UpstreamUnavailable as exc:
        reason = f"{exc}; the {NAME} baseline is skipped"
        print(f"{NAME}: SKIPPED: {reason}", flush=True)
        return {"skipped": reason}
    if model.device.type == "cuda":
        torch.cuda.empty_cache()  # upstream's module is gone with run_upstream's frame
    result["ratios"] = ratios(ours_rows, result["rows"])
    check = result["cross_check"]
    print(f"{NAME}: voxcpm {result['voxcpm']}, cross-check vs ours (batch {check['batch']} x {check['frames']} "
          f"frames): one-shot max |diff| {check['oneshot']['max_abs_diff']:.3g} SNR {check['oneshot']['snr_db']} dB, "
          f"4-frame streaming max |diff| {check['stream_t4']['max_abs_diff']:.3g}", flush=True)
    for r in result["rows"]:
        print_row(r, name_width=42)
    print(f"{NAME}: first patch of a stream p50 {result['stream']['first_patch_ms_p50']:.2f} ms", flush=True)
    for label, value in result["ratios"].items():
        print(f"ours vs upstream: {label} = {value:.2f}x", flush=True)
    return result
