"""Command-line options that ``demo`` and ``bench`` share with the client: the server's public key."""

from __future__ import annotations

import argparse

from code2wav.client.errors import SidecarError
from code2wav.client.keys import server_public_key


def server_key_arg(value: str) -> bytes:
    """argparse type for ``--server-key``: the client's one rule (``client.keys``); a bad value is a usage error
    at start, not a failure after the sidecar was spawned."""
    try:
        return server_public_key(value)
    except SidecarError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def add_server_key_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-key", type=server_key_arg,
                   help="with --address on CurveZMQ TCP: the sidecar's public key, the server.key file from "
                        "`code2wav-sidecar keygen` or the 40-character key it printed (default: unset, no CurveZMQ)")
