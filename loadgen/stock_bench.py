"""The bench's ``vllm-omni-stock`` phase: vLLM-Omni 0.30's own Code2Wav (``loadgen/stock.py``) timed in-process on
the same device, dtype, weights and chunking as the sidecar, in the same run.

Rows (same fields as the other in-process baselines):

- ``vllm-omni-stock-b1-t1``: a request's first chunk (1 frame), batch 1;
- ``vllm-omni-stock-bN``: steady-state 25-frame chunks of N requests in one runner step (N = 1 and the deploy
  file's ``decode_batch_max_size``, 4), each request already past the 72-frame sliding window, so every chunk is
  the rolling case (pre-transformer over 72 retained + 25 new frames, upsampler over 25 + 12).

Also: start-up (construct + its ``load_weights``, which captures its graphs on CUDA), capture time, the CUDA
memory its capture left reserved, and whether the vLLM import shim was used (``vllm_shim``).
"""

from __future__ import annotations

import argparse
import time

import torch

from code2wav.sidecar.cli_checks import int_list
from code2wav.sidecar.gc_pauses import FrozenWhile

from .timing import baseline_row, print_row
from .traffic import synthetic_codes

NAME = "vllm-omni-stock"
PRIME_CHUNKS = 3  # after 1 + 3 * 25 = 76 frames a request's suffix cache is rolling (>= the 72-frame window)


def add_stock_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vllm-omni-stock baseline (vLLM-Omni 0.30's own Qwen3TTSCode2Wav)")
    g.add_argument("--baseline", default="auto", choices=["auto", NAME, "none"],
                   help="auto: measure vllm-omni-stock when vllm-omni is importable (default)")
    g.add_argument("--stock-batch", type=int_list(1), default="1,4", help="comma-separated request counts per runner step")
    g.add_argument("--stock-graph-batch-sizes", type=int_list(1, allow_empty=True), default="",
                   help="decode_cudagraph_batch_sizes to capture (default: the deploy file's, i.e. [1])")
    g.add_argument("--stock-eager", action="store_true", help="enforce_eager (no CUDA graphs)")


def run_stock_phase(args: argparse.Namespace, model, codes: torch.Tensor | None = None) -> dict:
    """Build and time the stock baseline; returns ``{"rows": [...], ...}`` or ``{"skipped": reason}``."""
    from .stock import StockUnavailable, build_stock
    from .stock_shim import vllm_omni_installed

    if getattr(args, "baseline", "auto") == "none" or getattr(args, "no_baselines", False):
        return {"skipped": "not asked for"}
    if model is not None and not model.input.is_integer:
        reason = (f"model {model.name} decodes {model.input.kind}; vLLM-Omni's stock Code2Wav decodes codes only, "
                  "so the vllm-omni-stock baseline is skipped")
        print(f"\n{NAME}: SKIPPED: {reason}", flush=True)
        return {"skipped": reason}
    if not vllm_omni_installed():
        reason = "vllm-omni is not importable (pip install vllm-omni==0.30.0); the vllm-omni-stock baseline is skipped"
        print(f"\n{NAME}: SKIPPED: {reason}", flush=True)
        return {"skipped": reason}
    graph_batches = [int(x) for x in args.stock_graph_batch_sizes.split(",") if x] or None
    print(f"\n{NAME}: building vLLM-Omni's Qwen3TTSCode2Wav from its deploy file ...", flush=True)
    try:
        stock = build_stock(model, enforce_eager=True if args.stock_eager else None, graph_batch_sizes=graph_batches)
    except StockUnavailable as exc:
        print(f"{NAME}: SKIPPED: {exc}", flush=True)
        return {"skipped": str(exc)}
    info = {"vllm_shim": stock.vllm_shim, "graphs": stock.graphs, "startup_s": stock.startup_s,
            "capture_s": stock.capture_s, "graph_memory_bytes": stock.graph_memory_bytes,
            "graph_allocated_bytes": stock.graph_allocated_bytes,
            "graph_batch_sizes": stock.graph_batch_sizes, "graph_seq_lens": stock.graph_seq_lens,
            "deploy": stock.settings}
    print(f"{NAME}: vllm_shim={str(stock.vllm_shim).lower()} graphs={stock.graphs} startup {stock.startup_s:.2f} s"
          + (f", capture {stock.capture_s:.2f} s, graph memory {stock.graph_memory_bytes / 2**20:.1f} MiB "
             f"(batch sizes {stock.graph_batch_sizes}, frames {stock.graph_seq_lens})" if stock.capture_s else ""),
          flush=True)
    chunk = int(stock.settings["extra"]["codec_chunk_frames"])
    first = int(stock.settings["extra"]["initial_codec_chunk_frames"])
    iters, warmup = args.baseline_iters, getattr(args, "baseline_warmup", 3)
    total = first + (PRIME_CHUNKS + warmup + iters) * chunk
    if codes is None or codes.shape[1] < total:
        codes = synthetic_codes(model.num_quantizers, total, model.codebook_size, seed=5)
    rows = [_first_chunk_row(stock, codes[:, :first], model, iters, warmup)]
    for batch in (int(x) for x in args.stock_batch.split(",") if x):
        rows.append(_steady_row(stock, codes, batch, first, chunk, model, iters, warmup))
    for r in rows:
        print_row(r)
    print(f"vllm_shim: {str(stock.vllm_shim).lower()}", flush=True)
    del stock
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, **info}


def _timed_step(stock, chunks) -> float:
    t0 = time.perf_counter()
    stock.step(chunks)
    if stock.device.type == "cuda":
        torch.cuda.synchronize(stock.device)
    return time.perf_counter() - t0


def _first_chunk_row(stock, codes: torch.Tensor, model, iters: int, warmup: int) -> dict:
    times = []
    with torch.no_grad(), FrozenWhile():  # as time_calls times
        for i in range(warmup + iters):
            rid = f"stock-t1-{i}"
            elapsed = _timed_step(stock, [(rid, codes, 0, False)])
            stock.finish([rid])
            if i >= warmup:
                times.append(elapsed)
    return baseline_row(f"{NAME}-b1-t1", 1, codes.shape[1], times, model)


def _steady_row(stock, codes: torch.Tensor, batch: int, first: int, chunk: int, model, iters: int,
                warmup: int) -> dict:
    rids = [f"stock-b{batch}-{j}" for j in range(batch)]
    times = []
    with torch.no_grad(), FrozenWhile():  # as time_calls times
        stock.step([(rid, codes[:, :first], 0, False) for rid in rids])
        start = first
        for i in range(PRIME_CHUNKS + warmup + iters):
            chunks = [(rid, codes[:, start:start + chunk], 0, False) for rid in rids]
            elapsed = _timed_step(stock, chunks)
            if i >= PRIME_CHUNKS + warmup:
                times.append(elapsed)
            start += chunk
    stock.finish(rids)
    return baseline_row(f"{NAME}-b{batch}", batch, chunk, times, model)
