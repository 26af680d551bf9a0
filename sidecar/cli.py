"""``code2wav-sidecar`` command line: ``serve``, ``decode`` (offline), ``keygen``, and the client-side tools
``demo``, ``bench``, ``fidelity`` and ``profile``, which live in the ``loadgen`` package and run in their own process
(the server package never imports the client: they meet only on the wire).

Mistakes a person can make at the command line (a bad flag value, an address or port in use, a missing model
folder or input file) end with one ``error: ...`` line on stderr and exit code 2, never a traceback. The decode
checks live in ``offline``, the socket claim in ``transport``."""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import socket
import sys
import time
from pathlib import Path

CLIENT_SIDE_COMMANDS = ("demo", "bench", "fidelity", "profile")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
DTYPE_HELP = ("float32 (exact to the golden vectors), bfloat16 (about 2-3x the throughput on a GPU, half the "
              "state memory) or float16")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EXIT_USAGE = 2


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default (options without a help text too): argparse's own, or
    ``unset``/``off`` for None/False, unless the help text already states it."""

    @staticmethod
    def _default_suffix(action: argparse.Action) -> str | None:
        if action.default is argparse.SUPPRESS or not action.option_strings or action.required:
            return None
        if action.default is None:
            return "(default: unset)"
        if action.default is False and action.nargs == 0:
            return "(default: off)"
        return "(default: %(default)s)"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        suffix = self._default_suffix(action)
        if "default:" in text or suffix is None:
            return text
        return f"{text} {suffix}".strip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._default_suffix(action):  # argparse prints nothing for an empty help
            action = copy.copy(action)
            action.help = self._default_suffix(action)
        return super()._format_action(action)


def package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return "unknown"
    try:
        return version("code2wav-sidecar")
    except PackageNotFoundError:
        return "unknown (not installed)"


def version_text() -> str:
    from code2wav.proto import PROTOCOL_VERSION

    return f"code2wav-sidecar {package_version()} (wire protocol v{PROTOCOL_VERSION})"


def _serve_parser(sub) -> None:
    from .config import ServerConfig, StreamsConfig, default_address

    def cfg_default(name: str, section=ServerConfig) -> str:
        return f"default: {section.model_fields[name].default}"

    p = sub.add_parser("serve", help="run the sidecar server", formatter_class=DefaultsHelpFormatter,
                       description="Run the sidecar. Flags override the --config file, which overrides the "
                                   "defaults shown here.")
    p.add_argument("--config", help="YAML config file (see deploy/sidecar.yaml); flags below override it")
    p.add_argument("--address", help=f"ZeroMQ address to bind, ipc:///path or tcp://host:port (default: "
                   f"{default_address()}: $CODE2WAV_SIDECAR_ADDRESS, else a 0700 folder under $XDG_RUNTIME_DIR "
                   "or /tmp; clients use the same default)")
    p.add_argument("--model", help="a decoder model folder (its config.json names the family; see "
                   "docs/ARCHITECTURE.md), or 'default' (shipped architecture, random weights; "
                   f"{cfg_default('model')})")
    p.add_argument("--device", help=f"auto | cpu | cuda | cuda:N ({cfg_default('device')})")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help=f"{DTYPE_HELP} ({cfg_default('dtype')})")
    p.add_argument("--metrics-host", help=f"host for /metrics, /healthz, /readyz ({cfg_default('metrics_host')})")
    p.add_argument("--metrics-port", type=int, help="HTTP port for /metrics, /healthz, /readyz; 0 = any free "
                   f"({cfg_default('metrics_port')})")
    p.add_argument("--stream-ttl-s", type=float, help="reap streams idle longer than this many seconds "
                   f"({cfg_default('ttl_s', StreamsConfig)})")
    p.add_argument("--max-streams", type=int, help="stream slots in the state arena (default: as many as "
                   "streams.state_memory_bytes holds: auto = 2 GiB on CUDA, 256 MiB on CPU)")
    p.add_argument("--curve-secret-key-file", help="CurveZMQ server certificate (server.key_secret from "
                   "`keygen`), for non-loopback TCP (default: unset, no encryption)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback TCP bind without CurveZMQ (unauthenticated; logs a warning)")
    p.add_argument("--log-level", default="info", help=f"one of {', '.join(LOG_LEVELS)}")


def _decode_parser(sub) -> None:
    from code2wav.proto import STREAM_MODES

    p = sub.add_parser("decode", help="decode a codes .npy offline (no server)", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="default", help="speech_tokenizer/ folder, or 'default' (random weights)")
    p.add_argument("--input", required=True, help="integer codes .npy, shape [B, Q, T] (Q = the model's "
                   "quantizers), values in [0, codebook size); or float latents [B, D, T] / [D, T] for a latents model")
    p.add_argument("--output", required=True, help="out.npy (float32 [B, 1, T*U]) or out.wav (one file per row)")
    p.add_argument("--mode", choices=list(STREAM_MODES), default="exact",
                   help="exact: one forward over all frames; window: vLLM-Omni's chunked decode")
    p.add_argument("--chunk-frames", type=int, default=25, help="window mode: new frames per chunk")
    p.add_argument("--left-context-frames", type=int, default=25, help="window mode: left context per chunk")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help=DTYPE_HELP)
    p.add_argument("--time", action="store_true", help="print the decode time")
    p.add_argument("--sr-cond", type=int, help="stream option sr_cond: sample-rate condition in Hz, for models "
                   "that take it (welcome's stream_options; default: the model's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-sidecar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _decode_parser(sub)
    keygen = sub.add_parser("keygen", help="write a CurveZMQ certificate pair (server.key, server.key_secret)",
                            formatter_class=DefaultsHelpFormatter)
    keygen.add_argument("directory", help="folder for server.key and server.key_secret (created 0700)")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing key pair in the folder")
    for name in CLIENT_SIDE_COMMANDS:
        sub.add_parser(name, help=f"client-side tool (see `code2wav-sidecar {name} --help`)", add_help=False)
    return parser


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _port_in_use(host: str, port: int) -> OSError | None:
    """Try the bind the metrics server will do (port 0 always succeeds); the error if the port is taken."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return exc
    for family, kind, proto_num, _, sockaddr in infos:
        with socket.socket(family, kind, proto_num) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                return exc
    return None


def _serve_config(args: argparse.Namespace):
    from .config import load_config

    overrides = {"address": args.address, "model": args.model, "device": args.device, "dtype": args.dtype,
                 "metrics_host": args.metrics_host, "metrics_port": args.metrics_port}
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
    return cfg


def _check_serve_inputs(cfg) -> str | None:
    """What can be checked before the model loads (seconds): the model folder, the metrics port, the ipc://
    socket (refused when a live sidecar holds it, removed when stale). An error line, or None."""
    from .models import default_specs
    from .transport import AddressInUse, InsecureBind, check_bind_security, prepare_ipc_path

    if cfg.model not in default_specs() and not Path(cfg.model).is_dir():
        return (f"--model {cfg.model}: no such folder (give a decoder model folder, e.g. a TTS checkpoint's "
                "speech_tokenizer/, or 'default' for random weights)")
    taken = _port_in_use(cfg.metrics_host, cfg.metrics_port)
    if taken is not None:
        return (f"metrics port {cfg.metrics_port} on {cfg.metrics_host} is not available ({taken.strerror or taken}); "
                "choose another with --metrics-port (0 = any free port)")
    try:
        check_bind_security(cfg.address, cfg.security.curve_secret_key_file, cfg.security.insecure, warn=False)
        prepare_ipc_path(cfg.address)
    except (InsecureBind, AddressInUse) as exc:
        return str(exc)
    except OSError as exc:  # the socket folder cannot be created, or is another user's
        return f"cannot use {cfg.address}: {exc}"
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    import zmq

    from .config import ConfigError
    from .server import install_uvloop, run_server

    if args.log_level.lower() not in LOG_LEVELS:
        return _fail(f"--log-level {args.log_level}: choose one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _serve_config(args)
    except ConfigError as exc:
        return _fail(str(exc))
    problem = _check_serve_inputs(cfg)
    if problem is not None:
        return _fail(problem)
    loop_name = install_uvloop()

    def on_ready(server) -> None:
        import torch  # noqa: PLC0415 - loaded by the server already; `--help` stays fast

        m = server.model
        print(f"code2wav-sidecar ready: address={server.address} "
              f"metrics=http://{cfg.metrics_host}:{server.metrics_port}/metrics model={m.name} ({m.source}) "
              f"device={m.device} dtype={cfg.dtype} loop={loop_name} cpu_threads={torch.get_num_threads()}", flush=True)

    try:
        return asyncio.run(run_server(cfg, on_ready))
    except (ValueError, OSError, zmq.ZMQError) as exc:  # bad checkpoint or device, an address taken meanwhile ...
        return _fail(str(exc))


def cmd_decode(args: argparse.Namespace) -> int:
    from .offline import InputError, check_inputs, check_output_path, load_inputs_npy

    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    try:  # everything that needs no model first: a wrong path fails in a second, not after the model loads
        output = check_output_path(Path(args.output))
        codes = load_inputs_npy(Path(args.input))
    except InputError as exc:
        return _fail(str(exc))
    from .models import default_specs, load_model, resolve_device
    from .modes import get_mode
    from .offline import decode_offline, save_audio

    if args.model not in default_specs() and not Path(args.model).is_dir():
        return _fail(f"--model {args.model}: no such folder (give a model folder or one of {sorted(default_specs())})")

    try:
        model = load_model(args.model, resolve_device(args.device), args.dtype)
        codes_t = check_inputs(codes, args.input, model.input)  # [B, C, T] int64 codes or float32 latents
        options = model.contract.check_options({} if args.sr_cond is None else {"sr_cond": args.sr_cond})
    except (InputError, ValueError, RuntimeError) as exc:  # inputs or options vs model, a bad checkpoint or device
        return _fail(str(exc))
    t0 = time.perf_counter()
    wav = decode_offline(model, codes_t, get_mode(args.mode), args.chunk_frames, args.left_context_frames,
                         options)  # [B, 1, T * U]
    elapsed_s = time.perf_counter() - t0
    written = save_audio(output, wav, model.sample_rate_hz)
    audio_s = wav.shape[0] * wav.shape[2] / model.sample_rate_hz
    shown = "".join(f", {name}={value}" for name, value in options.items())
    print(f"decoded {tuple(codes.shape)} -> {tuple(wav.shape)} ({audio_s:.2f} s of audio, mode={args.mode}{shown}) "
          f"into {', '.join(map(str, written))}")
    if args.time:
        print(f"decode time: {elapsed_s * 1e3:.1f} ms ({audio_s / elapsed_s:.1f}x real time)")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    folder = Path(args.directory)
    existing = [folder / name for name in ("server.key", "server.key_secret") if (folder / name).exists()]
    if existing and not args.force:
        return _fail(f"{', '.join(map(str, existing))} already exist(s); clients trust that key. Pass --force to "
                     "replace it (then give clients the new public key), or choose another folder")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        public_file, secret_file = zmq.auth.create_certificates(str(folder), "server")
        os.chmod(secret_file, 0o600)
    except OSError as exc:
        return _fail(f"cannot write the key pair into {folder}: {exc.strerror or exc}")
    public_key, _ = zmq.auth.load_certificate(public_file)
    print(f"wrote {public_file} (give it, or the key below, to clients: --server-key / curve_server_key) and "
          f"{secret_file} (keep it secret: --curve-secret-key-file {secret_file})")
    print(f"server public key: {public_key.decode()}")
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
