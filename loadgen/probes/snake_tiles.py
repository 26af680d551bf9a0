"""Each Snake kernel call of one exact step, timed alone with its variants (developer tool, CUDA GPU).

Runs one step of ``MODEL`` at ``BATCH`` x ``FRAMES`` (``StreamRoutine.forward``, as ``kernel_count.py``) and keeps
the arguments of every ``code2wav::snake_cat`` / ``snake_pairs`` call. Then each call runs
alone, timed as ``ConvChoice`` times its forms (``conv_choice.min_device_ms``: CUDA events, the minimum of a few
calls, each queued behind a ~1 ms GPU spin, so the ~100 us of host work per Triton launch stays out of the device
time) with each variant: a sine of ``snake_apply`` (``SINE``: 0 libdevice ``sinf``, 1 ``sin_squared``, 2 the
hardware's ``sin.approx``) and, for the tiled kernel (channels-last input or output, frame pairs), a ``(channels,
columns)`` tile. Per call: the layouts, the state's columns ``P``, the bytes it must move (``x`` read, output
written) and the bandwidth each variant reaches; then the sums over the step. (Run without the spin, the 2026-12-02 H200 run
that chose ``sin_squared`` counted ~100 us of launch per call: its b1 rows are that floor.)

``python loadgen/probes/snake_tiles.py`` (``MODEL=default BATCH=16 FRAMES=25 DTYPE=bfloat16``;
``TILES=auto,32x128,64x64w8`` picks the tiles: channels x columns, optionally w and the warps, ``auto`` being
``snake.tile_for``'s per call; ``SINES=1,2`` the sines; each tile runs with each sine. Last, the sums per kind of
call (op and layouts) and the best variant of each.)
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.kernels import snake
from code2wav.sidecar.kernels.conv_choice import min_device_ms
from code2wav.sidecar.models import load_model
from code2wav.sidecar.state_store import StateArena

MODEL = os.environ.get("MODEL", "default")
BATCH = int(os.environ.get("BATCH", "16"))
FRAMES = int(os.environ.get("FRAMES", "25"))
DTYPE = os.environ.get("DTYPE", "bfloat16")
TILES = [None if t == "auto" else tuple(int(n) for n in t.replace("w", "x").split("x"))
         for t in os.environ.get("TILES", "auto,32x128,64x64,16x256,128x32").split(",")]  # CxT or CxTwWARPS
SINES = [int(n) for n in os.environ.get("SINES", "1,2").split(",")]
OPS = ("snake_cat", "snake_pairs")


class SnakeCalls(TorchDispatchMode):
    """Keeps (op name, its arguments by name, cloned) of every Snake op call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in OPS:
            named = {arg.name: arg.default_value for arg in func._schema.arguments if arg.has_default_value()}
            named.update(zip((arg.name for arg in func._schema.arguments), args))
            named.update(kwargs or {})
            self.calls.append((name, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in named.items()}))
        return func(*args, **(kwargs or {}))


def _launcher(name: str, a: dict):
    """``(run(tile, sine), channels_last, pairs)`` for one recorded call, through ``snake._launch``."""
    state = None if a["state"] is None else a["state"].to(a["x"].dtype)
    pairs = name == "snake_pairs"
    channels_last = a.get("channels_last", False)

    def run(tile, sine):
        warps = dict(num_warps=tile[2]) if tile is not None and len(tile) > 2 else {}
        return snake._launch(a["x"], state, a["alpha"], a["beta"], a["lengths"], a["log_params"], a["in_bias"],
                             pairs=pairs, channels_last=channels_last,
                             block_tile=None if tile is None else tile[:2], sine=sine, **warps)
    return run, channels_last, pairs


def _name(tile) -> str:
    return "auto" if tile is None else "x".join(map(str, tile[:2])) + (f"w{tile[2]}" if len(tile) > 2 else "")


def _time_us(fn, x: torch.Tensor) -> float:
    return min_device_ms(lambda _: fn(), x) * 1e3


def main() -> None:
    device = torch.device("cuda")
    model = load_model(MODEL, device, DTYPE)
    arena = StateArena(model.module.state_layout(), BATCH, model.dtype, model.device)
    routine = StreamRoutine(model, arena, BATCH, FRAMES)
    routine.prime(BATCH, FRAMES)
    with torch.inference_mode():
        routine.forward(BATCH, FRAMES)
        with SnakeCalls() as rec:
            routine.forward(BATCH, FRAMES)
        torch.cuda.synchronize()
        variants = [(t, sine) for sine in SINES for t in TILES]
        print(f"{MODEL} {DTYPE} one exact step {BATCH} x {FRAMES}: {len(rec.calls)} Snake calls; "
              f"us per variant (tile CxT s sine), bandwidth of the best")
        print("  " + " | ".join(f"{_name(t)} s{f}" for t, f in variants))
        sums = [0.0] * len(variants)
        kinds: dict[str, list[float]] = {}  # op and layouts -> summed us per variant
        best_sum, bytes_sum = 0.0, 0
        for name, named in rec.calls:
            run, channels_last, pairs = _launcher(name, named)
            x = named["x"]
            tiled = pairs or channels_last or x.stride(2) != 1
            out, _ = run(TILES[0], 0)
            nbytes = x.numel() * x.element_size() + out.numel() * out.element_size()
            timed: dict[tuple, float] = {}
            for tile, sine in variants:  # the one-channel-per-program kernel has no tile: timed once per sine
                key = (tile if tiled else None, sine)
                if key not in timed:
                    timed[key] = _time_us(lambda: run(tile, sine), x)
            us = [timed[(t if tiled else None, f)] for t, f in variants]
            sums = [total + u for total, u in zip(sums, us)]
            best = min(us)
            best_sum += best
            bytes_sum += nbytes
            layout = "pairs" if pairs else ("cl" if channels_last else "contig")
            x_layout = "cl" if x.stride(1) == 1 else "contig"
            kind = f"{name} {x_layout}->{layout}"
            kinds[kind] = [k + u for k, u in zip(kinds.get(kind, [0.0] * len(us)), us)]
            num_state_cols = 0 if named["state"] is None else named["state"].shape[2]
            print(f"  {name:12s} x{tuple(x.shape)} P{num_state_cols:<3d} {x_layout}->{layout:6s} "
                  f"{nbytes / 1e6:7.1f} MB "
                  + " ".join(f"{u:7.1f}" for u in us) + f"  best {nbytes / best / 1e3:6.0f} GB/s")
        print("  sum: " + " | ".join(f"{s:.0f}" for s in sums) + f" us; best per call {best_sum:.0f} us, "
              f"{bytes_sum / 1e6:.0f} MB, {bytes_sum / best_sum / 1e3:.0f} GB/s")
        for kind, summed in kinds.items():
            best = min(range(len(variants)), key=summed.__getitem__)
            tile, sine = variants[best]
            print(f"  by kind: {kind:36s} " + " ".join(f"{u:7.0f}" for u in summed)
                  + f"  best {_name(tile)} s{sine}")


if __name__ == "__main__":
    main()
