"""A separate client process for multi-process tests: streams rows of the golden codes with random chunk
sizes, pipelining chunks, and saves the concatenated audio per stream to an .npz file."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from code2wav.client import SidecarClient  # noqa: E402


def main(address: str, golden: str, prefix: str, num_streams: int, seed: int, out: str) -> None:
    codes = load_file(golden)["codes"]  # [2, Q, T]
    rng = random.Random(seed)
    total = codes.shape[2]
    results = {}
    with SidecarClient(address, timeout_s=60) as client:
        streams = [client.open_stream(f"{prefix}-{i}") for i in range(num_streams)]
        plans, futures = [], [[] for _ in streams]
        for _ in streams:
            cuts = sorted(rng.sample(range(1, total), rng.randint(1, 8)))
            bounds = [0, *cuts, total]
            plans.append(list(zip(bounds[:-1], bounds[1:])))
        # interleave the streams' chunks in random order, keeping each stream's own order
        cursors = [0] * len(streams)
        while any(c < len(p) for c, p in zip(cursors, plans)):
            i = rng.choice([k for k in range(len(streams)) if cursors[k] < len(plans[k])])
            start, end = plans[i][cursors[i]]
            final = cursors[i] == len(plans[i]) - 1
            futures[i].append(streams[i].submit(codes[i % 2, :, start:end], final=final))
            cursors[i] += 1
            time.sleep(rng.random() * 0.003)
        for i, fs in enumerate(futures):
            results[f"row{i % 2}_{i}"] = np.concatenate([f.result(timeout=60).numpy() for f in fs])
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
