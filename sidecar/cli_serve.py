"""``code2wav-sidecar serve``: its options, the checks that need no model (seconds, before the model loads), and
the run. A mistake ends in one ``error:`` line and exit code 2; the ready line names the address and the
metrics URL (with the port chosen when ``--metrics-port 0``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from pathlib import Path

from .cli_checks import (DEVICE_HELP, address_arg, check_device, device_arg, fail, float_above, input_file,
                         int_at_least)
from .cli_help import DTYPE_CHOICES, DTYPE_HELP, DefaultsHelpFormatter, command_epilog
from .cpu_dtype import cpu_dtype_warning

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SERVE_DESCRIPTION = ("Run the sidecar: load a decoder model, bind a ZeroMQ address, serve clients until SIGINT or "
                     "SIGTERM (queued chunks finish first). Flags override the --config file, which overrides the "
                     "defaults shown here. Prints one ready line with the address and the metrics URL.")
SERVE_EXAMPLE = "code2wav-sidecar serve --model default --device cpu --metrics-port 0"


def port_arg(text: str) -> int:
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0 = any free port), got {text!r}")
    return value


def add_serve_parser(sub) -> None:
    from .config import ServerConfig, StreamsConfig, default_address

    def cfg_default(name: str, section=ServerConfig) -> str:
        return f"default: {section.model_fields[name].default}"

    p = sub.add_parser("serve", help="run the sidecar server", formatter_class=DefaultsHelpFormatter,
                       description=SERVE_DESCRIPTION, epilog=command_epilog(SERVE_EXAMPLE))
    p.add_argument("--config", type=input_file, help="YAML config file (see deploy/sidecar.yaml); flags below "
                   "override it")
    p.add_argument("--address", type=address_arg, help=f"ZeroMQ address to bind, ipc:///path or tcp://host:port "
                   f"(default: {default_address()}: $CODE2WAV_SIDECAR_ADDRESS, else a 0700 folder under "
                   "$XDG_RUNTIME_DIR or /tmp; clients use the same default)")
    p.add_argument("--model", help="a decoder model folder (a TTS checkpoint's decoder folder, e.g. its "
                   "speech_tokenizer/), or a random-weights name: 'default', or a family's NAME-default (shipped "
                   f"architecture, random weights; {cfg_default('model')})")
    p.add_argument("--device", type=device_arg, help=f"{DEVICE_HELP} ({cfg_default('device')})")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help=f"{DTYPE_HELP} ({cfg_default('dtype')})")
    p.add_argument("--metrics-host", help=f"host for /metrics, /healthz, /readyz ({cfg_default('metrics_host')})")
    p.add_argument("--metrics-port", type=port_arg, help="HTTP port for /metrics, /healthz, /readyz; 0 = any free "
                   f"port, printed in the ready line ({cfg_default('metrics_port')})")
    p.add_argument("--stream-ttl-s", type=float_above(0), help="reap streams idle longer than this many seconds "
                   f"({cfg_default('ttl_s', StreamsConfig)})")
    p.add_argument("--max-streams", type=int_at_least(1), help="stream slots in the state arena (default: as many "
                   "as streams.state_memory_bytes holds: auto = 2 GiB on CUDA, 256 MiB on CPU)")
    p.add_argument("--curve-secret-key-file", type=input_file, help="CurveZMQ server certificate "
                   "(server.key_secret from `keygen`), for a tcp:// address (refused with ipc://, which file "
                   "permissions protect; default: unset, no encryption)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback TCP bind without CurveZMQ (unauthenticated; logs a warning)")
    p.add_argument("--log-level", default="info", help=f"one of {', '.join(LOG_LEVELS)}")


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


def _check_security(cfg) -> str | None:
    """A CurveZMQ key (or client allow-list) given for an ipc:// address is refused: ipc:// sockets take no
    CurveZMQ here (the 0700 folder and 0600 socket are the access control), and a key silently not applied
    would look like encryption that is not there."""
    sec = cfg.security
    if not cfg.address.startswith("ipc://"):
        if sec.curve_secret_key_file and not Path(sec.curve_secret_key_file).is_file():
            return f"--curve-secret-key-file {sec.curve_secret_key_file}: no such file"
        return None
    given = [name for name, value in (("--curve-secret-key-file (security.curve_secret_key_file)",
                                       sec.curve_secret_key_file),
                                      ("security.curve_allowed_clients_dir", sec.curve_allowed_clients_dir)) if value]
    if given:
        return (f"{given[0]} is for tcp:// addresses, but the address is {cfg.address}: an ipc:// socket is protected "
                "by its file permissions (0700 folder, 0600 socket) and takes no CurveZMQ; drop the key, or bind "
                "a tcp://host:port address")
    return None


def check_serve_inputs(cfg) -> str | None:
    """What can be checked before the model loads (seconds): the device, the model folder, the metrics port, the
    address and its security, the ipc:// socket (refused when a live sidecar holds it, removed when stale). An
    error line, or None."""
    from .models.registry import check_model_spec
    from .transport import AddressInUse, InsecureBind, check_bind_security, prepare_ipc_path

    problem = check_device(cfg.device) or check_model_spec(cfg.model) or _check_security(cfg)
    if problem is not None:
        return problem
    if not cfg.address.startswith(("ipc://", "tcp://")):
        return f"--address {cfg.address}: use ipc:///path/to/socket or tcp://host:port"
    taken = _port_in_use(cfg.metrics_host, cfg.metrics_port)
    if taken is not None:
        return (f"--metrics-port {cfg.metrics_port}: metrics port {cfg.metrics_port} on {cfg.metrics_host} is not "
                f"available ({taken.strerror or taken}); choose another, or --metrics-port 0 for any free port "
                "(the ready line prints it)")
    try:
        check_bind_security(cfg.address, cfg.security.curve_secret_key_file, cfg.security.insecure, warn=False)
        prepare_ipc_path(cfg.address)
    except (InsecureBind, AddressInUse) as exc:
        return str(exc)
    except OSError as exc:  # the socket folder cannot be created, or is another user's
        return f"cannot use {cfg.address}: {exc}"
    return None


def _missing_folders(address: str) -> list[Path]:
    """The folders of an ipc:// socket path that do not exist yet (start-up creates them), deepest first."""
    if not address.startswith("ipc://"):
        return []
    missing = []
    folder = Path(address[len("ipc://"):]).parent
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first; a folder something else wrote into stays
        try:
            folder.rmdir()
        except OSError:
            break


def cmd_serve(args: argparse.Namespace) -> int:
    import zmq

    from .config import ConfigError
    from .models import resolve_device
    from .server import install_uvloop, run_server

    if args.log_level.lower() not in LOG_LEVELS:
        return fail(f"--log-level {args.log_level}: choose one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _serve_config(args)
    except ConfigError as exc:
        return fail(str(exc))
    created = _missing_folders(cfg.address)
    problem = check_serve_inputs(cfg)
    if problem is not None:
        _remove_empty(created)
        return fail(problem)
    warning = cpu_dtype_warning(resolve_device(cfg.device).type, cfg.dtype)
    if warning:
        logging.getLogger("code2wav.sidecar").warning(warning)
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
        _remove_empty(created)  # a failed start leaves no socket folder behind
        return fail(str(exc))
