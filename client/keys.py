"""The sidecar's CurveZMQ public key as clients take it: ONE rule for ``SidecarClient(curve_server_key=...)``,
``code2wav-sidecar demo --server-key`` and ``bench --server-key``.

The value is a file path or the key itself: when a file exists at that path it is read as a ZeroMQ certificate
(``server.key`` written by ``code2wav-sidecar keygen DIR``; its public key is used, so ``server.key_secret`` works
too); otherwise it must be the 40-character Z85 text of the key (what ``keygen`` prints).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import os
import struct

import zmq.auth
from zmq.utils import z85

from .errors import InvalidArgument

__all__ = ["Z85_KEY_CHARS", "server_public_key"]

Z85_KEY_CHARS = 40
"""A CurveZMQ key (32 bytes) in Z85 text."""

_HINT = ("give the sidecar's public key: the server.key file written by `code2wav-sidecar keygen DIR`, or the "
         "40-character key it printed")


def server_public_key(value: bytes | str | os.PathLike) -> bytes:
    """The Z85 public key (40 bytes) from a certificate file path or from the key text; ``InvalidArgument`` else."""
    text = os.fsdecode(value).strip() if isinstance(value, (str, os.PathLike)) else bytes(value).decode("latin-1")
    if os.path.isfile(text):
        try:
            public, _secret = zmq.auth.load_certificate(text)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"server key file {text}: not a ZeroMQ certificate ({exc}); {_HINT}") from None
        return public
    if len(text) == Z85_KEY_CHARS:
        try:
            z85.decode(text.encode("latin-1"))
        except (ValueError, KeyError, UnicodeEncodeError, struct.error):
            pass
        else:
            return text.encode("latin-1")
    shown = text if len(text) <= 80 else text[:77] + "..."
    raise InvalidArgument(f"server key {shown!r} is neither an existing certificate file nor a "
                          f"{Z85_KEY_CHARS}-character Z85 key; {_HINT}")
