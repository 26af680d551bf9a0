"""``code2wav-sidecar demo``: stream synthetic codes (Qwen3-TTS) or latents (VoxCPM2) through a sidecar in the
chunks the model family's talker sends through vLLM-Omni, print each chunk's latency, write a WAV."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from code2wav.client import SidecarClient
from code2wav.proto.address import default_address
from code2wav.sidecar.cli_checks import (DEVICE_HELP, OneLineParser, UsageError, address_arg, device_arg,
                                         int_at_least, output_file)
from code2wav.sidecar.cli_help import DefaultsHelpFormatter, command_epilog
from code2wav.sidecar.offline import write_wav

from .inputs import InputContract, synthetic_inputs
from .options import add_server_key_option
from .spawn import spawn_sidecar
from .traffic import chunk_sizes

DEMO_SECONDS = 10.0  # of audio, when --frames is not given
DESCRIPTION = ("Stream seeded synthetic codes or latents through a sidecar (a spawned one, or --address) the way "
               "vLLM-Omni sends a talker's output: Qwen3-TTS a 1-frame first chunk then 25-frame chunks, VoxCPM2 "
               "4-frame patches. Prints each chunk's latency and writes the audio to a WAV file.")
EXAMPLE = "code2wav-sidecar demo --device cpu --output demo.wav"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="code2wav-sidecar demo", description=DESCRIPTION, formatter_class=DefaultsHelpFormatter,
                      epilog=command_epilog(EXAMPLE))
    p.add_argument("--address", type=address_arg, help="connect to a running sidecar instead of spawning one; "
                   f"'default' = the address `serve` binds by default, here {default_address(os.environ, os.getuid())}"
                   " (default: unset, spawn one)")
    add_server_key_option(p)
    p.add_argument("--model", default="default", help="for a spawned sidecar: a model folder, or 'default' / "
                   "'voxcpm2-default' (random weights)")
    p.add_argument("--device", type=device_arg, default="auto", help=f"for a spawned sidecar: {DEVICE_HELP}")
    p.add_argument("--frames", type=int_at_least(1), help=f"frames to stream (default: about {DEMO_SECONDS:g} s of "
                   "audio in the family's chunks; Qwen3-TTS 12.5 frames/s, VoxCPM2 25)")
    p.add_argument("--mode", choices=["exact", "window"], default="exact", help="stream mode")
    p.add_argument("--first-chunk-frames", type=int_at_least(1), help="frames in the first chunk (default: the "
                   "family's: 1 Qwen3-TTS, 4 VoxCPM2)")
    p.add_argument("--chunk-frames", type=int_at_least(1), help="frames in each later chunk (default: the family's: "
                   "25 Qwen3-TTS, 4 VoxCPM2)")
    p.add_argument("--output", type=output_file(".wav"), default="demo.wav", help="WAV file to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic inputs")
    return p


def window_left_context(family: str) -> int:
    """Window mode's left context frames for the family (its talker's chunking through vLLM-Omni)."""
    from code2wav.sidecar.models.registry import chunking_of

    return chunking_of(family).window_left_context_frames


def plan_chunks(args: argparse.Namespace, family: str, frame_rate_hz: float | None) -> list[int]:
    """The chunk sizes to send: the family's chunking (``models.registry.CHUNKING``) where a flag is unset; a size
    that is not a whole number of the family's patches is a ``UsageError``. Without ``frame_rate_hz`` (the model
    not known yet) only the given sizes are checked, and ``[]`` comes back."""
    from code2wav.sidecar.models.registry import chunking_of

    c = chunking_of(family)
    first = c.first_chunk_frames if args.first_chunk_frames is None else args.first_chunk_frames
    later = c.chunk_frames if args.chunk_frames is None else args.chunk_frames
    for flag, value in (("--first-chunk-frames", first), ("--chunk-frames", later), ("--frames", args.frames)):
        if value is not None and value % c.patch_frames:
            raise UsageError(f"{flag} {value}: this model ({family}) takes whole {c.patch_frames}-frame patches; "
                             f"give a multiple of {c.patch_frames}")
    if frame_rate_hz is None:
        return []
    frames = args.frames
    if frames is None:  # the first chunk, then whole later chunks up to about DEMO_SECONDS of audio
        frames = first + later * max(1, round((DEMO_SECONDS * frame_rate_hz - first) / later))
    return chunk_sizes(frames, first, later)


def _spawn_checks(args: argparse.Namespace) -> str:
    """For a spawned sidecar, before it starts: the device and the model; returns the model's family name."""
    from code2wav.sidecar.cli_checks import check_device
    from code2wav.sidecar.models.registry import check_model_spec, family_of_spec

    problem = check_device(args.device) or check_model_spec(args.model)
    if problem is not None:
        raise UsageError(problem)
    return family_of_spec(args.model).name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spawned = None
    address = args.address
    if address is None:
        plan_chunks(args, _spawn_checks(args), None)  # sizes against the family's patches, before spawning
        print(f"starting a sidecar (model={args.model}, device={args.device}) ...", flush=True)
        spawned = spawn_sidecar("--model", args.model, "--device", args.device)
        print(spawned.banner(), flush=True)
        address = spawned.address
    elif address == "default":
        address = None  # the client applies the default rule
    try:
        with SidecarClient(address, timeout_s=60, curve_server_key=args.server_key) as client:
            info = client.models[0]
            sizes = plan_chunks(args, info.family, info.sample_rate / info.samples_per_frame)
            inputs = synthetic_inputs(InputContract.of(info), sum(sizes), args.seed)  # [Q, T] codes or [D, T] latents
            stream = client.open_stream("demo-0", mode=args.mode, left_context_frames=window_left_context(info.family))
            pieces, start = [], 0
            print(f"{'chunk':>5} {'frames':>6} {'samples':>8} {'latency_ms':>10}")
            for i, n in enumerate(sizes):
                t0 = time.perf_counter()
                wav = stream.decode(inputs[:, start:start + n], final=(i == len(sizes) - 1))  # [n * U]
                latency_ms = (time.perf_counter() - t0) * 1e3
                print(f"{i:>5} {n:>6} {wav.numel():>8} {latency_ms:>10.2f}")
                pieces.append(wav)
                start += n
            audio = torch.cat(pieces).numpy()  # [T * U]
            write_wav(Path(args.output), audio, info.sample_rate)
            print(f"wrote {args.output}: {audio.size / info.sample_rate:.2f} s at {info.sample_rate} Hz "
                  f"(model {info.name}, mode {args.mode}, {len(sizes)} chunks of {sorted(set(sizes))} frames)")
    finally:
        if spawned is not None:
            spawned.stop()
    return 0
