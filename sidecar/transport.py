"""ZeroMQ transport: one ROUTER socket; moves frames, never interprets them and never calls a model.

ipc:// sockets are created inside a directory only the owner can enter (0700) and chmod'ed 0600; for the default
address every folder below its trusted root is created 0700 and checked first (``ensure_private_dirs``,
``proto.socket_dir``).
Frames are received without copies (``copy=False``) and sent zero-copy for large buffers.

The socket is a plain (non-asyncio) one, used from the server's loop thread only: the loop watches its file
descriptor and the server drains it with non-blocking receives, which costs far less per message than
``zmq.asyncio``'s futures. The descriptor only says the socket's state may have changed, and a send may
consume that signal; so after sending, the server asks ``readable()`` before waiting on the descriptor again.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import zmq
import zmq.auth

from code2wav import proto
from code2wav.proto.socket_dir import default_socket_root, level_problem, root_problem, socket_levels

log = logging.getLogger(__name__)

ZERO_COPY_MIN_NBYTES = 64 * 1024  # below this a copy is cheaper than pinning the buffer
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
"""As plain ints: ``readable`` runs once per busy-poll turn, and pyzmq's enum arithmetic took a third of its time
(2.2 against 1.5 us a call on the CPU machine)."""


PROBE_TIMEOUT_S = 1.0
"""How long a starting server waits for an answer from whatever holds its ipc:// socket file."""


class AddressInUse(OSError):
    """The address is held by a live process: a running sidecar, or another program."""


def _probe_sidecar(address: str, timeout_s: float) -> str | None:
    """Say ``hello`` (then ``bye``) on ``address``: the answering sidecar's server id, or None if none answered."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        hello = proto.Hello(request_id=1, version=proto.PROTOCOL_VERSION,
                            client_id=f"code2wav-sidecar-probe:{os.getpid()}")
        sock.send_multipart(proto.encode(hello))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        try:
            reply = proto.decode_server_message(sock.recv_multipart())
        except proto.ProtocolError:
            return "?"  # it speaks ZeroMQ and answered, but not our protocol version
        server_id = getattr(reply, "server_id", "?")
        sock.send_multipart(proto.encode(proto.Bye(request_id=2)), zmq.NOBLOCK)
        return server_id
    finally:
        sock.close(linger=100)
        ctx.term()


def _socket_is_live(path: Path) -> bool:
    """True when a process accepts connections on the Unix socket ``path``; False for a stale file."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(PROBE_TIMEOUT_S)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # e.g. a timeout: something holds it; refuse rather than steal
    finally:
        probe.close()
    return True


def claim_ipc_path(address: str, path: Path) -> None:
    """Refuse an ipc:// socket file that a live process serves; remove a stale one (of a crashed run)."""
    if not (path.exists() or path.is_symlink()):
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise AddressInUse(f"{path} exists and is not a socket; remove it or choose another --address")
    if _socket_is_live(path):
        server_id = _probe_sidecar(address, PROBE_TIMEOUT_S)
        who = f"a running sidecar ({server_id})" if server_id else "another program (it did not answer hello)"
        raise AddressInUse(f"address in use by {who}: {address}. Stop it first, or give this one another --address")
    log.info("removing the stale socket %s (no process listens on it)", path)
    path.unlink()


class UnsafeSocketDir(PermissionError):
    """A folder of the default socket's path that another user could control; the message names it and the fix."""


def ensure_private_dirs(root: str, socket_dir: str, uid: int) -> None:
    """Create the missing levels from ``root`` down to ``socket_dir`` 0700, then check each (``proto.socket_dir``:
    ours alone, not a symlink, the root trusted); raises ``UnsafeSocketDir`` naming the first bad one."""
    try:
        problem = root_problem(root, os.stat(root), uid)
    except OSError as exc:
        problem = f"socket root {root} cannot be read ({exc.strerror}); set XDG_RUNTIME_DIR or --address"
    if problem is not None:
        raise UnsafeSocketDir(problem)
    for level in socket_levels(root, socket_dir):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            pass  # (someone's: checked below like one of ours)
        problem = level_problem(level, os.lstat(level), uid)
        if problem is not None:
            raise UnsafeSocketDir(problem)


def prepare_ipc_path(address: str) -> Path | None:
    """Create the socket's parent directory 0700 (refuse one others can enter) and claim the socket file (refuse a
    live one, remove a stale one); None for non-ipc addresses. For the default address every level below its
    trusted root is checked first (``proto.socket_dir``: ours alone, no symlink; ``UnsafeSocketDir`` otherwise)."""
    if not address.startswith("ipc://"):
        return None
    path = Path(address[len("ipc://"):])
    parent = path.parent
    root = default_socket_root(address, os.environ, os.getuid())
    if root is not None:  # the default address: every level below /tmp or $XDG_RUNTIME_DIR must be ours alone
        ensure_private_dirs(root, str(parent), os.getuid())
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(parent.stat().st_mode)
    if mode & 0o077:
        if parent.stat().st_uid != os.getuid():
            raise PermissionError(f"socket directory {parent} is open to other users (mode {mode:o}) and not ours")
        os.chmod(parent, 0o700)
    claim_ipc_path(address, path)
    return path


class InsecureBind(ValueError):
    """A non-loopback TCP bind without CurveZMQ and without --insecure."""


def is_loopback_tcp(address: str) -> bool:
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a DNS name: treat as reachable from other hosts
        return False


def check_bind_security(address: str, curve_secret_key_file: str | None, insecure: bool, warn: bool = True) -> str:
    """``"ipc"``, ``"loopback"``, ``"curve"`` or ``"insecure"``; raises ``InsecureBind`` when not allowed."""
    if not address.startswith("tcp://"):
        return "ipc"
    if is_loopback_tcp(address):
        return "loopback"
    if curve_secret_key_file:
        return "curve"
    if insecure:
        if warn:
            log.warning("SECURITY: %s is reachable from other hosts WITHOUT encryption or authentication "
                    "(--insecure). Anyone who can reach it can decode and disrupt streams.", address)
        return "insecure"
    raise InsecureBind(
        f"refusing to bind {address}: it is reachable from other hosts. Bind 127.0.0.1, or give a CurveZMQ "
        "certificate (security.curve_secret_key_file, made with `code2wav-sidecar keygen DIR`), or pass "
        "--insecure to accept an unauthenticated, unencrypted socket.")


class Transport:
    def __init__(self, ctx: zmq.Context, address: str, max_message_bytes: int,
                 curve_secret_key_file: str | None = None, insecure: bool = False) -> None:
        self.address = address
        self.security = check_bind_security(address, curve_secret_key_file, insecure, warn=False)
        self.socket = ctx.socket(zmq.ROUTER)
        if self.security == "curve":
            public, secret = zmq.auth.load_certificate(curve_secret_key_file)
            if not secret:
                raise ValueError(f"{curve_secret_key_file} holds no secret key (use the .key_secret file)")
            self.socket.curve_server = True
            self.socket.curve_secretkey = secret
            self.socket.curve_publickey = public
            log.info("CurveZMQ enabled; clients need the server public key from %s.key (not logged here)",
                     Path(curve_secret_key_file).with_suffix(""))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 100_000)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Hard per-frame cap in libzmq (a peer over it is disconnected); the typed check at
        # max_message_bytes happens in proto, so this only guards memory against hostile peers.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes + (1 << 20))
        try:
            ipc_path = prepare_ipc_path(address)
            self.socket.bind(address)
        except zmq.ZMQError as exc:
            self.socket.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:
                raise AddressInUse(f"address in use: {address} is bound by another process. Stop it first, or "
                                   "give this one another --address") from None
            raise ValueError(f"cannot bind {address}: {exc}") from None
        except BaseException:
            self.socket.close(linger=0)
            raise
        if ipc_path is not None:
            os.chmod(ipc_path, 0o600)
        self.bound_address = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.last_user_id: str | None = None  # CURVE: the client key (ZAP user id) of the last message received
        self.num_sent = 0  # replies handed to libzmq (the shutdown counts those of its drain)

    @property
    def fd(self) -> int:
        """Readable when the socket's state may have changed (then drain with ``recv_nowait``)."""
        return self.socket.getsockopt(zmq.FD)

    def readable(self) -> bool:
        """A message is waiting (also re-arms the descriptor's signal)."""
        return bool(self.socket.getsockopt(EVENTS) & POLLIN)

    def recv_nowait(self) -> tuple[bytes, list] | None:
        """``(identity, frames)`` of the next message, or None when none is waiting; frames are zero-copy.
        (Asking ``ZMQ_EVENTS`` first is cheaper than the ``zmq.Again`` a receive on an empty socket raises.)"""
        if not self.readable():
            return None
        try:
            parts = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if self.security == "curve":
            self.last_user_id = parts[0].get("User-Id") or None
        return parts[0].bytes, [p.buffer for p in parts[1:]]

    def send(self, identity: bytes, message, buffers: list, sending: Callable[[], None] | None = None) -> None:
        """``sending``: called once the message is encoded, right before libzmq gets it (a chunk trace's stamp)."""
        frames = [identity, *proto.encode(message, buffers)]
        big = any(memoryview(f).nbytes >= ZERO_COPY_MIN_NBYTES for f in frames[2:])
        if sending is not None:
            sending()
        try:  # ROUTER never blocks: a reply to a vanished or saturated peer is dropped by libzmq
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=not big)
            self.num_sent += 1
        except zmq.ZMQError as exc:
            log.warning("sending a reply failed: %s", exc)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket. ``linger_s`` > 0: libzmq keeps sending the queued replies for up to that long, and the
        context's ``term()`` returns once they are all sent (or the time ran out: the rest is dropped)."""
        self.socket.close(linger=int(linger_s * 1000))
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)
