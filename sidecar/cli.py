"""The ``code2wav-sidecar`` command line: ``serve`` (cli_serve), ``decode`` (cli_decode), ``keygen``, and the
client-side tools ``demo``, ``bench``, ``fidelity`` and ``profile``, which live in the ``loadgen`` package and run
in their own process (the server package never imports the client: they meet only on the wire).

Every command checks its options before any work (cli_checks): a mistake is one ``error:`` line on stderr and
exit code 2, nothing written; an unexpected failure is one line naming a log file with the traceback, exit 1."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .cli_checks import EXIT_USAGE, OneLineParser, fail, run_guarded
from .cli_help import DTYPE_CHOICES, DTYPE_HELP, DefaultsHelpFormatter, command_epilog

__all__ = ["DTYPE_CHOICES", "DTYPE_HELP", "DefaultsHelpFormatter", "EXIT_USAGE", "build_parser", "main",
           "package_version", "version_text"]

CLIENT_SIDE_COMMANDS = ("demo", "bench", "fidelity", "profile")
CLIENT_SIDE_HELP = {
    "demo": "stream synthetic codes/latents through a sidecar the way vLLM-Omni chunks them, write a WAV",
    "bench": "measure a sidecar's latency and throughput against in-process baselines",
    "fidelity": "compare each streaming path's audio with one decode of all frames",
    "profile": "time one decode step operator by operator (or kernel by kernel on a GPU)",
}
DESCRIPTION = ("code2wav-sidecar: the codec/vocoder stage of TTS serving (a talker's codes or latents in, audio "
               "out) as a server that vLLM-Omni and other clients stream chunks to. `code2wav-sidecar COMMAND --help` lists "
               "a command's options.")
EXAMPLES = ("code2wav-sidecar serve --model default", "code2wav-sidecar demo --device cpu")
KEYGEN_DESCRIPTION = ("Write a CurveZMQ certificate pair into a folder: server.key (public, for clients: "
                      "--server-key) and server.key_secret (for serve --curve-secret-key-file). Needed to serve "
                      "tcp:// beyond loopback.")


def package_version() -> str:
    """The package's version (``code2wav.__version__``: the installed metadata, else pyproject's)."""
    from code2wav import __version__

    return __version__


def version_text() -> str:
    from code2wav.proto import PROTOCOL_VERSION

    return f"code2wav-sidecar {package_version()} (wire protocol v{PROTOCOL_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    from .cli_decode import add_decode_parser
    from .cli_serve import add_serve_parser

    parser = OneLineParser(prog="code2wav-sidecar", description=DESCRIPTION, formatter_class=DefaultsHelpFormatter,
                           epilog=command_epilog(*EXAMPLES))
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
    add_decode_parser(sub)
    keygen = sub.add_parser("keygen", help="write a CurveZMQ certificate pair (server.key, server.key_secret)",
                            formatter_class=DefaultsHelpFormatter, description=KEYGEN_DESCRIPTION,
                            epilog=command_epilog("code2wav-sidecar keygen keys/"))
    keygen.add_argument("directory", help="folder for server.key and server.key_secret (created 0700)")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing key pair in the folder")
    for name in CLIENT_SIDE_COMMANDS:
        sub.add_parser(name, help=CLIENT_SIDE_HELP[name], add_help=False)
    return parser


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    folder = Path(args.directory)
    if folder.exists() and not folder.is_dir():
        return fail(f"{folder}: is a file; give a folder for server.key and server.key_secret")
    existing = [folder / name for name in ("server.key", "server.key_secret") if (folder / name).exists()]
    if existing and not args.force:
        return fail(f"{', '.join(map(str, existing))} already exist(s); clients trust that key. Pass --force to "
                    "replace it (then give clients the new public key), or choose another folder")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        public_file, secret_file = zmq.auth.create_certificates(str(folder), "server")
        os.chmod(secret_file, 0o600)
    except OSError as exc:
        return fail(f"cannot write the key pair into {folder}: {exc.strerror or exc}")
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
        from .cli_serve import cmd_serve

        return run_guarded("serve", lambda: cmd_serve(args))
    if args.command == "keygen":
        return run_guarded("keygen", lambda: cmd_keygen(args))
    from .cli_decode import cmd_decode

    return run_guarded("decode", lambda: cmd_decode(args))
