"""``code2wav-sidecar demo``: stream synthetic codes through a sidecar the way vLLM-Omni chunks them, write
a WAV, print per-chunk latency."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from code2wav.client import SidecarClient
from code2wav.proto.address import default_address
from code2wav.sidecar.cli import DefaultsHelpFormatter
from code2wav.sidecar.offline import write_wav

from .options import add_server_key_option
from .spawn import spawn_sidecar
from .inputs import InputContract, synthetic_inputs
from .traffic import chunk_sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="code2wav-sidecar demo", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--address", help="connect to a running sidecar instead of spawning one; 'default' = "
                   f"the address `serve` binds by default, here {default_address(os.environ, os.getuid())} "
                   "(default: unset, spawn one)")
    add_server_key_option(p)
    p.add_argument("--model", default="default", help="for a spawned sidecar: folder or 'default'")
    p.add_argument("--device", default="auto", help="for a spawned sidecar")
    p.add_argument("--frames", type=int, default=126, help="codec frames to stream (12.5 frames = 1 s)")
    p.add_argument("--mode", choices=["exact", "window"], default="exact", help="stream mode")
    p.add_argument("--first-chunk-frames", type=int, default=1, help="frames in the first chunk")
    p.add_argument("--chunk-frames", type=int, default=25, help="frames in each later chunk")
    p.add_argument("--output", default="demo.wav", help="WAV file to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic codes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spawned = None
    address = args.address
    if address is None:
        print(f"starting a sidecar (model={args.model}, device={args.device}) ...", flush=True)
        spawned = spawn_sidecar("--model", args.model, "--device", args.device)
        print(spawned.banner(), flush=True)
        address = spawned.address
    elif address == "default":
        address = None  # the client applies the default rule
    try:
        with SidecarClient(address, timeout_s=60, curve_server_key=args.server_key) as client:
            info = client.models[0]
            codes = synthetic_inputs(InputContract.of(info), args.frames, args.seed)  # [Q, T] codes or [D, T] latents
            stream = client.open_stream("demo-0", mode=args.mode)
            sizes = chunk_sizes(args.frames, args.first_chunk_frames, args.chunk_frames)
            pieces, start = [], 0
            print(f"{'chunk':>5} {'frames':>6} {'samples':>8} {'latency_ms':>10}")
            for i, n in enumerate(sizes):
                t0 = time.perf_counter()
                wav = stream.decode(codes[:, start:start + n], final=(i == len(sizes) - 1))
                latency_ms = (time.perf_counter() - t0) * 1e3
                print(f"{i:>5} {n:>6} {wav.numel():>8} {latency_ms:>10.2f}")
                pieces.append(wav)
                start += n
            audio = torch.cat(pieces).numpy()
            write_wav(Path(args.output), audio, info.sample_rate)
            print(f"wrote {args.output}: {audio.size / info.sample_rate:.2f} s at {info.sample_rate} Hz "
                  f"(model {info.name}, mode {args.mode}, {len(sizes)} chunks)")
    finally:
        if spawned is not None:
            spawned.stop()
    return 0
