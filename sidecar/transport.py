"""ZeroMQ transport: one ROUTER socket; moves frames, never interprets them and never calls a model.

ipc:// sockets are created inside a directory only the owner can enter (0700) and chmod'ed 0600.
Frames are received without copies (``copy=False``) and sent zero-copy for large buffers.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import zmq
import zmq.asyncio

import proto

log = logging.getLogger(__name__)

ZERO_COPY_MIN_NBYTES = 64 * 1024  # below this a copy is cheaper than pinning the buffer


def prepare_ipc_path(address: str) -> Path | None:
    """Create the socket's parent directory 0700 (refuse one others can enter); None for non-ipc addresses."""
    if not address.startswith("ipc://"):
        return None
    path = Path(address[len("ipc://"):])
    parent = path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(parent.stat().st_mode)
    if mode & 0o077:
        if parent.stat().st_uid != os.getuid():
            raise PermissionError(f"socket directory {parent} is open to other users (mode {mode:o}) and not ours")
        os.chmod(parent, 0o700)
    if path.exists():
        path.unlink()  # a stale socket of a previous run
    return path


def _log_send_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("sending a reply failed: %s", future.exception())


class Transport:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, max_message_bytes: int) -> None:
        self.address = address
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 100_000)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Hard per-frame cap in libzmq (a peer over it is disconnected); the typed check at
        # max_message_bytes happens in proto, so this only guards memory against hostile peers.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes + (1 << 20))
        ipc_path = prepare_ipc_path(address)
        self.socket.bind(address)
        if ipc_path is not None:
            os.chmod(ipc_path, 0o600)
        self.bound_address = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def recv(self) -> tuple[bytes, list]:
        """``(identity, frames)`` of the next message; frames are zero-copy buffers."""
        parts = await self.socket.recv_multipart(copy=False)
        identity = parts[0].bytes
        return identity, [p.buffer for p in parts[1:]]

    def poll_nowait(self) -> bool:
        return bool(self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def send(self, identity: bytes, message, buffers: list) -> None:
        frames = [identity, *proto.encode(message, buffers)]
        big = any(memoryview(f).nbytes >= ZERO_COPY_MIN_NBYTES for f in frames[2:])
        # ROUTER never blocks: a reply to a vanished or saturated peer is dropped by libzmq.
        done = self.socket.send_multipart(frames, copy=not big)
        done.add_done_callback(_log_send_failure)

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)
