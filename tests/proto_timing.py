"""How fast ``proto`` encodes and parses its hot messages (not a test: run it, compare before/after on one CPU).

    python tests/proto_timing.py [--repeat 7] [--module code2wav.proto [--module oldproto]]

Prints, per case, the best of ``--repeat`` timeit runs in microseconds per call: ``encode`` (``to_wire`` and
msgpack) and ``parse`` (``decode_client_message`` / ``decode_server_message``) of a 1-chunk and a 64-chunk
inline ``decode``, a ``decode_result`` with 64 results, a ``hello`` and a ``welcome``. ``--module`` (repeatable)
times other copies of the package (e.g. the old one, copied to a folder on ``PYTHONPATH``) in turns with it,
to compare them on one machine.
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


def _timers(proto: Any) -> dict[tuple[str, str], timeit.Timer]:
    timers = {}
    for name, (make, parser_name) in CASES.items():
        parse = getattr(proto, parser_name)
        msg, buffers = make(proto)
        frames = proto.encode(msg, buffers)
        assert parse(frames) == msg
        timers[name, "encode"] = timeit.Timer(lambda msg=msg, buffers=buffers: proto.encode(msg, buffers))
        timers[name, "parse"] = timeit.Timer(lambda parse=parse, frames=frames: parse(frames))
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--module", action="append", default=[],
                        help="a proto package to time (repeatable; default code2wav.proto); several are timed "
                             "in turns, so drifts of the machine's speed hit them alike")
    args = parser.parse_args()
    modules = args.module or ["code2wav.proto"]
    timers = {module: _timers(importlib.import_module(module)) for module in modules}
    best: dict[tuple[str, str, str], float] = {}
    for _ in range(args.repeat):
        for key in timers[modules[0]]:
            for module in modules:
                timer = timers[module][key]
                number = max(1, timer.autorange()[0] // 4)
                seconds = timer.timeit(number) / number
                best[(module, *key)] = min(best.get((module, *key), seconds), seconds)
    header = "".join(f" {module + ' ' + what:>28}" for module in modules for what in ("encode us", "parse us"))
    print(f"{'case':<18}{header}")
    for name in CASES:
        cells = "".join(f" {best[module, name, what] * 1e6:>28.2f}"
                        for module in modules for what in ("encode", "parse"))
        print(f"{name:<18}{cells}")


if __name__ == "__main__":
    main()
