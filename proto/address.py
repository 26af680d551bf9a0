"""The default sidecar address: ONE rule, used by ``serve`` (where it binds) and by every client (the Python
client, the vLLM-Omni delegate, ``demo`` and ``bench``), so that both sides meet without configuration.

A pure function of the environment and the user id (sans-IO: nothing is read here, the caller passes both):

1. ``$CODE2WAV_SIDECAR_ADDRESS`` when set and not empty (any ZeroMQ address: ``ipc://...`` or ``tcp://...``);
2. else ``ipc://$XDG_RUNTIME_DIR/code2wav/sidecar.sock`` when ``XDG_RUNTIME_DIR`` is set (a per-user 0700
   directory on systemd hosts);
3. else ``ipc:///tmp/code2wav-sidecar-<uid>/code2wav/sidecar.sock`` (the sidecar creates the folders 0700).

Rules: no I/O (the environment and uid are arguments); imports only the standard library; imports nothing else
of this project.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["ADDRESS_ENV", "SOCKET_RELATIVE_PATH", "default_address"]

ADDRESS_ENV = "CODE2WAV_SIDECAR_ADDRESS"
SOCKET_RELATIVE_PATH = "code2wav/sidecar.sock"


def default_address(env: Mapping[str, str], uid: int) -> str:
    """The address ``serve`` binds and clients connect to when none is given (rule in the module docstring)."""
    explicit = (env.get(ADDRESS_ENV) or "").strip()
    if explicit:
        return explicit
    runtime_dir = (env.get("XDG_RUNTIME_DIR") or "").rstrip("/")
    base = runtime_dir if runtime_dir else f"/tmp/code2wav-sidecar-{uid}"
    return f"ipc://{base}/{SOCKET_RELATIVE_PATH}"
