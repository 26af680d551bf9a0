"""``code2wav-sidecar`` command line: ``serve``, ``decode`` (offline), and the client-side tools ``demo`` and
``bench``, which live in the ``loadgen`` package and run in their own process (the server package never
imports the client: they meet only on the wire)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

CLIENT_SIDE_COMMANDS = ("demo", "bench")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the sidecar server")
    p.add_argument("--config", help="YAML config file (see README); flags below override it")
    p.add_argument("--address", help="ZeroMQ address to bind (default: ipc:// socket in a private directory)")
    p.add_argument("--model", help="speech_tokenizer/ folder, or 'default' (shipped architecture, random weights)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--metrics-host", help="host for /metrics, /healthz, /readyz (default 127.0.0.1)")
    p.add_argument("--metrics-port", type=int, help="HTTP port for /metrics, /healthz, /readyz (0 = any free)")
    p.add_argument("--stream-ttl-s", type=float, help="reap streams idle longer than this")
    p.add_argument("--max-streams", type=int, help="stream slots in the state arena")
    p.add_argument("--curve-secret-key-file", help="CurveZMQ server certificate (from `keygen`), for non-loopback TCP")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback TCP bind without CurveZMQ (unauthenticated; logs a warning)")
    p.add_argument("--log-level", default="INFO")


def _decode_parser(sub) -> None:
    p = sub.add_parser("decode", help="decode a codes .npy offline (no server)")
    p.add_argument("--model", default="default")
    p.add_argument("--input", required=True,
                   help="int64 codes .npy [B, Q, T]; for a VoxCPM2 model (or 'voxcpm2-default'): float latents "
                        ".npy [B, D, T] or [D, T]")
    p.add_argument("--output", required=True, help="out.npy (float32 [B, 1, T*U]) or out.wav")
    p.add_argument("--mode", choices=["exact", "window"], default="exact")
    p.add_argument("--chunk-frames", type=int, default=25, help="window mode: new frames per chunk")
    p.add_argument("--left-context-frames", type=int, default=25, help="window mode: left context per chunk")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--time", action="store_true", help="print the decode time")
    p.add_argument("--sr-cond", type=int, help="VoxCPM2 only: sample-rate condition in Hz (default 48000)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-sidecar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _decode_parser(sub)
    keygen = sub.add_parser("keygen", help="write a CurveZMQ certificate pair (server.key, server.key_secret)")
    keygen.add_argument("directory")
    for name in CLIENT_SIDE_COMMANDS:
        sub.add_parser(name, help=f"client-side tool (see `code2wav-sidecar {name} --help`)", add_help=False)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .server import install_uvloop, run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {"address": args.address, "model": args.model, "device": args.device, "dtype": args.dtype,
                 "metrics_host": args.metrics_host, "metrics_port": args.metrics_port}
    try:
        cfg = load_config(args.config, overrides)
        if args.curve_secret_key_file or args.insecure:
            security = cfg.security.model_dump()
            security["curve_secret_key_file"] = args.curve_secret_key_file or security["curve_secret_key_file"]
            security["insecure"] = args.insecure or security["insecure"]
            overrides["security"] = security
            cfg = load_config(args.config, overrides)
        if args.stream_ttl_s is not None or args.max_streams is not None:
            streams = cfg.streams.model_dump()
            if args.stream_ttl_s is not None:
                streams["ttl_s"] = args.stream_ttl_s
            if args.max_streams is not None:
                streams["max_streams"] = args.max_streams
            cfg = load_config(args.config, {**overrides, "streams": streams})
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    loop_name = install_uvloop()

    def on_ready(server) -> None:
        m = server.model
        print(f"code2wav-sidecar ready: address={server.address} "
              f"metrics=http://{cfg.metrics_host}:{server.metrics_port}/metrics model={m.name} ({m.source}) "
              f"device={m.device} dtype={cfg.dtype} loop={loop_name}", flush=True)

    try:
        return asyncio.run(run_server(cfg, on_ready))
    except (ValueError, OSError) as exc:  # bad model folder, device, address in use ...
        logging.getLogger("code2wav_sidecar").error("%s", exc)
        return 2


def cmd_decode(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from .engine import Engine
    from .models import load_model, resolve_device
    from .offline import decode_exact, decode_window, save_audio
    from .state_store import StateArena

    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    from .offline_latents import cmd_decode_latents, is_latents_model
    if is_latents_model(args.model):
        return cmd_decode_latents(args)
    if args.sr_cond is not None:
        print(f"error: --sr-cond applies to VoxCPM2 models only, not --model {args.model}", file=sys.stderr)
        return 2
    codes = np.load(args.input, allow_pickle=False)
    if codes.ndim != 3 or codes.dtype.kind not in "iu":
        print(f"error: {args.input}: expected integer codes [B, Q, T], got {codes.dtype} {codes.shape}", file=sys.stderr)
        return 2
    model = load_model(args.model, resolve_device(args.device), args.dtype)
    if codes.shape[1] != model.num_quantizers or codes.min() < 0 or codes.max() >= model.codebook_size:
        print(f"error: codes must be [B, {model.num_quantizers}, T] with values in [0, {model.codebook_size})",
              file=sys.stderr)
        return 2
    engine = Engine(model, StateArena(model.module.state_layout(), 1, model.dtype, model.device))
    codes_t = torch.from_numpy(codes.astype(np.int64))
    t0 = time.perf_counter()
    if args.mode == "exact":
        wav = decode_exact(engine, codes_t)
    else:
        wav = decode_window(engine, codes_t, args.chunk_frames, args.left_context_frames)
    elapsed_s = time.perf_counter() - t0
    written = save_audio(Path(args.output), wav, model.sample_rate_hz)
    audio_s = wav.shape[0] * wav.shape[2] / model.sample_rate_hz
    print(f"decoded {tuple(codes.shape)} -> {tuple(wav.shape)} ({audio_s:.2f} s of audio, mode={args.mode}) "
          f"into {', '.join(map(str, written))}")
    if args.time:
        print(f"decode time: {elapsed_s * 1e3:.1f} ms ({audio_s / elapsed_s:.1f}x real time)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in CLIENT_SIDE_COMMANDS:
        # Client-side tools run as their own process: exec replaces this one, no import of the client here.
        os.execv(sys.executable, [sys.executable, "-m", "code2wav.loadgen", *argv])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "keygen":
        return cmd_keygen(args)
    return cmd_decode(args)


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    folder = Path(args.directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(str(folder), "server")
    os.chmod(secret_file, 0o600)
    public_key, _ = zmq.auth.load_certificate(public_file)
    print(f"wrote {public_file} (give its key to clients) and {secret_file} (keep it secret: "
          f"--curve-secret-key-file {secret_file})")
    print(f"server public key: {public_key.decode()}")
    return 0
