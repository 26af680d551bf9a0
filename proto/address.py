"""The default sidecar address: ONE rule, used by ``serve`` (where it binds) and by every client (the Python
client, the vLLM-Omni delegate, ``demo`` and ``bench``), so that both sides meet without configuration.

A pure function of the environment and the user id (sans-IO: nothing is read here, the caller passes both):

1. ``$CODE2WAV_SIDECAR_ADDRESS`` when set and not empty (any ZeroMQ address: ``ipc://...`` or ``tcp://...``);
2. else ``ipc://$XDG_RUNTIME_DIR/code2wav/sidecar.sock`` when ``XDG_RUNTIME_DIR`` is set (a per-user 0700
   directory on systemd hosts);
3. else ``ipc:///tmp/code2wav-sidecar-<uid>/code2wav/sidecar.sock`` (the sidecar creates the folders 0700).

For rules 2 and 3 both sides check every folder below ``$XDG_RUNTIME_DIR`` or ``/tmp`` before they use it (this
user's alone, not a symlink: ``socket_dir``).

Rules: no I/O (the environment and uid are arguments); imports only the standard library; imports nothing else
of this project.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["ADDRESS_ENV", "SOCKET_RELATIVE_PATH", "ADDRESS_FORMS", "default_address", "address_problem"]

ADDRESS_ENV = "CODE2WAV_SIDECAR_ADDRESS"
SOCKET_RELATIVE_PATH = "code2wav/sidecar.sock"
ADDRESS_FORMS = "ipc:///path/to/sidecar.sock or tcp://host:port"


def default_address(env: Mapping[str, str], uid: int) -> str:
    """The address ``serve`` binds and clients connect to when none is given (rule in the module docstring)."""
    explicit = (env.get(ADDRESS_ENV) or "").strip()
    if explicit:
        return explicit
    runtime_dir = (env.get("XDG_RUNTIME_DIR") or "").rstrip("/")
    base = runtime_dir if runtime_dir else f"/tmp/code2wav-sidecar-{uid}"
    return f"ipc://{base}/{SOCKET_RELATIVE_PATH}"


def address_problem(address: str) -> str | None:
    """What is wrong with a sidecar address, in one line that says what to write instead; None when it has one
    of the two forms the sidecar speaks (``ipc://PATH``, ``tcp://HOST:PORT``)."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return f"address {address!r} has no scheme: use {ADDRESS_FORMS}"
    if scheme not in ("ipc", "tcp"):
        return f"address {address!r}: the sidecar listens on ipc:// or tcp:// only; use {ADDRESS_FORMS}"
    if scheme == "ipc" and not rest:
        return f"address {address!r} names no socket file: use {ADDRESS_FORMS}"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"address {address!r} needs a host and a port 1-65535: use {ADDRESS_FORMS}"
    return None
