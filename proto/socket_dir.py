"""The default ipc:// socket's folders, checked by both sides: the sidecar before it binds (it also creates the
missing levels 0700, ``sidecar/transport.py``), a client before it connects to the default address
(``address.default_address``, rules 2 and 3).

Why: in a shared ``/tmp`` another local user can create ``/tmp/code2wav-sidecar-<uid>`` first, or later move a
level aside, bind a socket of their own there and answer the sidecar's clients with their own ``welcome``. So
every level from the trusted root (``$XDG_RUNTIME_DIR``, else ``/tmp``) down to the socket's folder must be:

- a real folder, not a symlink;
- owned by this user (for root too: root accepts no folder of another user);
- writable by nobody else (no group or other write bit).

The root itself must be owned by this user or by root, and sticky when others may write to it (``/tmp``'s mode
1777), so nobody else can rename a level inside it. A level that does not exist yet ends the walk: nobody controls
it (the sidecar creates it 0700, then checks it like the others, which also closes the race with a user who
creates it in between). Each problem is one line naming the path and the fix.

Rules: no I/O here (sans-IO like the rest of ``proto``): the caller passes ``os.stat`` (called as
``stat(path, follow_symlinks=...)``, raising ``FileNotFoundError`` for a missing level); mode bits are spelled out
(no ``stat`` module); imports only ``typing`` and this package.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .address import ADDRESS_ENV, default_address

__all__ = ["default_socket_root", "socket_levels", "root_problem", "level_problem", "socket_dir_problem",
           "default_socket_problem", "StatFn"]

StatFn = Callable[..., Any]
"""``os.stat``: ``stat(path, follow_symlinks=bool)`` -> an object with ``st_mode`` and ``st_uid``."""

FIX = ("remove it (ask its owner or an admin if it is not yours), or set XDG_RUNTIME_DIR or --address / "
       "$CODE2WAV_SIDECAR_ADDRESS to a folder only you can write")
_S_IFMT, _S_IFDIR, _S_IFLNK = 0o170000, 0o040000, 0o120000
_S_ISVTX = 0o1000  # sticky
_GROUP_OTHER_WRITE = 0o022


def default_socket_root(address: str, env: Mapping[str, str], uid: int) -> str | None:
    """The trusted root above ``address`` when it is the default ipc:// address (``$XDG_RUNTIME_DIR`` or
    ``/tmp``); None for any other address (an explicit one, or ``$CODE2WAV_SIDECAR_ADDRESS``: the operator's)."""
    if (env.get(ADDRESS_ENV) or "").strip() or address != default_address(env, uid):
        return None
    return (env.get("XDG_RUNTIME_DIR") or "").rstrip("/") or "/tmp"


def socket_levels(root: str, socket_dir: str) -> list[str]:
    """The folders from just below ``root`` down to ``socket_dir`` (which lies under it), outermost first."""
    parts = [p for p in socket_dir[len(root):].split("/") if p]
    if not socket_dir.startswith(root.rstrip("/") + "/") or ".." in parts:
        raise ValueError(f"{socket_dir} is not below {root}")
    return [root.rstrip("/") + "/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def root_problem(root: str, st: Any, uid: int) -> str | None:
    """What is wrong with the trusted root (``st``: its ``os.stat``, symlinks followed), or None."""
    if st.st_mode & _S_IFMT != _S_IFDIR:
        return f"socket root {root} is not a folder; set XDG_RUNTIME_DIR or --address"
    if st.st_uid not in (uid, 0):
        return f"socket root {root} is owned by uid {st.st_uid}, not by you or root; set XDG_RUNTIME_DIR or --address"
    if st.st_mode & _GROUP_OTHER_WRITE and not st.st_mode & _S_ISVTX:
        return (f"socket root {root} is writable by others (mode {st.st_mode & 0o7777:o}) without the sticky bit; "
                "set XDG_RUNTIME_DIR or --address to a private folder")
    return None


def level_problem(level: str, st: Any, uid: int) -> str | None:
    """What is wrong with one level below the root (``st``: its ``os.stat`` without following symlinks), or None."""
    kind = st.st_mode & _S_IFMT
    if kind == _S_IFLNK:
        return f"socket folder {level} is a symlink; {FIX}"
    if kind != _S_IFDIR:
        return f"socket folder {level} is not a folder; {FIX}"
    if st.st_uid != uid:
        return f"socket folder {level} is owned by uid {st.st_uid}, not by you (uid {uid}); {FIX}"
    if st.st_mode & _GROUP_OTHER_WRITE:
        return f"socket folder {level} is writable by others (mode {st.st_mode & 0o7777:o}); {FIX}"
    return None


def socket_dir_problem(root: str, socket_dir: str, uid: int, stat: StatFn) -> str | None:
    """One line naming the first unsafe level from ``root`` to ``socket_dir`` (and the fix), or None. A level that
    does not exist ends the walk."""
    try:
        problem = root_problem(root, stat(root, follow_symlinks=True), uid)
    except OSError as exc:
        return f"socket root {root} cannot be read ({exc.strerror}); set XDG_RUNTIME_DIR or --address"
    if problem is not None:
        return problem
    for level in socket_levels(root, socket_dir):
        try:
            st = stat(level, follow_symlinks=False)
        except FileNotFoundError:
            return None
        problem = level_problem(level, st, uid)
        if problem is not None:
            return problem
    return None


def default_socket_problem(address: str, env: Mapping[str, str], uid: int, stat: StatFn) -> str | None:
    """A client's check before it connects: when ``address`` is the default ipc:// address, the first unsafe level
    of its path (one line with the fix); None otherwise."""
    root = default_socket_root(address, env, uid)
    if root is None:
        return None
    socket_dir = address[len("ipc://"):].rsplit("/", 1)[0]
    return socket_dir_problem(root, socket_dir, uid, stat)
