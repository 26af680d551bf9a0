"""How fast ``proto`` encodes and parses its hot messages (not a test: run it, compare before/after on one CPU).

    python tests/proto_timing.py [--repeat 7] [--module code2wav.proto]

Prints, per case, the best of ``--repeat`` timeit runs in microseconds per call: ``encode`` (``to_wire`` and
msgpack) and ``parse`` (``decode_client_message`` / ``decode_server_message``) of a 1-chunk and a 64-chunk
inline ``decode``, a ``decode_result`` with 64 results, a ``hello`` and a ``welcome``. ``--module`` times another
copy of the package (e.g. the old one, copied to a folder on ``PYTHONPATH``), to compare on one machine.
"""

from __future__ import annotations

import argparse
import importlib
import timeit
from typing import Any, Callable

Q, N, U = 16, 25, 1920  # quantizers, frames per chunk, samples per frame


def _decode(proto: Any, num_chunks: int) -> tuple[Any, list[bytes]]:
    chunks = tuple(proto.Chunk(f"stream-{i}", 7, proto.TensorDesc("int64", (Q, N), proto.InlineLoc(i + 1)),
                               context_frames=0) for i in range(num_chunks))
    return proto.Decode(42, chunks), [bytes(Q * N * 8)] * num_chunks


def _decode_result(proto: Any, num_results: int) -> tuple[Any, list[bytes]]:
    results = tuple(proto.ChunkResult(f"stream-{i}", 7, proto.TensorDesc("float32", (N * U,), proto.InlineLoc(i + 1)),
                                      N) for i in range(num_results))
    return proto.DecodeResult(42, results), [bytes(N * U * 4)] * num_results


def _welcome(proto: Any) -> tuple[Any, list[bytes]]:
    model = proto.ModelInfo("qwen3-tts-12hz", Q, 2048, U, 24000, ("exact", "window"), "bfloat16", "cuda:0",
                            family="qwen3_tts", input_channels=Q, input_range=(0, 2048))
    return proto.Welcome(1, 1, "gpu-node-3", "1732860000-8f2a", (model,), "qwen3-tts-12hz",
                         capabilities={"cuda_ipc": False}, session_secret="s" * 32), []


def _hello(proto: Any) -> tuple[Any, list[bytes]]:
    return proto.Hello(1, 1, "host:4242:9f1c", {"cuda_ipc": False, "gpu_uuid": None}), []


CASES: dict[str, tuple[Callable[[Any], tuple[Any, list[bytes]]], str]] = {
    "decode 1 chunk": (lambda proto: _decode(proto, 1), "decode_client_message"),
    "decode 64 chunks": (lambda proto: _decode(proto, 64), "decode_client_message"),
    "decode_result 64": (lambda proto: _decode_result(proto, 64), "decode_server_message"),
    "hello": (_hello, "decode_client_message"),
    "welcome": (_welcome, "decode_server_message"),
}


def _best_us(fn: Callable[[], Any], repeat: int) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--module", default="code2wav.proto")
    args = parser.parse_args()
    proto = importlib.import_module(args.module)
    print(f"{'case':<18} {'encode us':>10} {'parse us':>10}")
    for name, (make, parser_name) in CASES.items():
        parse = getattr(proto, parser_name)
        msg, buffers = make(proto)
        frames = proto.encode(msg, buffers)
        assert parse(frames) == msg
        encode_us = _best_us(lambda: proto.encode(msg, buffers), args.repeat)
        parse_us = _best_us(lambda: parse(frames), args.repeat)
        print(f"{name:<18} {encode_us:>10.2f} {parse_us:>10.2f}")


if __name__ == "__main__":
    main()
