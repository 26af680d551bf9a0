"""``code2wav-sidecar demo``: stream synthetic codes through a sidecar the way vLLM-Omni chunks them, write
a WAV, print per-chunk latency."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from code2wav.client import SidecarClient
from code2wav.sidecar.offline import write_wav

from .spawn import spawn_sidecar
from .traffic import chunk_sizes, synthetic_codes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="code2wav-sidecar demo", description=__doc__)
    p.add_argument("--address", help="connect to a running sidecar instead of spawning one")
    p.add_argument("--model", default="default", help="for a spawned sidecar: folder or 'default'")
    p.add_argument("--device", default="auto", help="for a spawned sidecar")
    p.add_argument("--frames", type=int, default=126, help="codec frames to stream (12.5 frames = 1 s)")
    p.add_argument("--mode", choices=["exact", "window"], default="exact")
    p.add_argument("--first-chunk-frames", type=int, default=1)
    p.add_argument("--chunk-frames", type=int, default=25)
    p.add_argument("--output", default="demo.wav")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spawned = None
    address = args.address
    if address is None:
        print(f"starting a sidecar (model={args.model}, device={args.device}) ...", flush=True)
        spawned = spawn_sidecar("--model", args.model, "--device", args.device)
        print(spawned.ready_line, flush=True)
        address = spawned.address
    try:
        with SidecarClient(address, timeout_s=60) as client:
            info = client.models[0]
            codes = synthetic_codes(info.num_quantizers, args.frames, info.codebook_size, args.seed)
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
