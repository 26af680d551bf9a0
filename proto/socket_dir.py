"""The default ipc:// socket's folders, checked by both sides: the sidecar before it binds, a client before it
connects to the default address (``address.default_address``, rules 2 and 3).

Why: in a shared ``/tmp`` another local user can create ``/tmp/code2wav-sidecar-<uid>`` first, or later move a
level aside, bind a socket of their own there and answer the sidecar's clients with their own ``welcome``. So
every level from the trusted root (``$XDG_RUNTIME_DIR``, else ``/tmp``) down to the socket's folder must be:

- a real folder, not a symlink;
- owned by this user (for root too: root accepts no folder of another user);
- writable by nobody else (no group or other write bit).

The root itself must be owned by this user or by root, and sticky when others may write to it (``/tmp``'s mode
1777), so nobody else can rename a level inside it. A level that does not exist yet is created 0700 by the sidecar
(``ensure_private_dirs``) and then checked like the others, which also closes the race with a user who creates it
in between. The only I/O here is ``lstat``/``mkdir`` on those folders; the messages name the path and the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Mapping

from .address import ADDRESS_ENV, default_address

__all__ = ["default_socket_root", "socket_dir_problem", "ensure_private_dirs", "default_socket_problem",
           "UnsafeSocketDir"]

FIX = ("remove it (ask its owner or an admin if it is not yours), or set XDG_RUNTIME_DIR or --address / "
       "$CODE2WAV_SIDECAR_ADDRESS to a folder only you can write")


class UnsafeSocketDir(PermissionError):
    """A level of the default socket's path that another user could control; the message names it and the fix."""


def default_socket_root(address: str, env: Mapping[str, str], uid: int) -> Path | None:
    """The trusted root above ``address`` when it is the default ipc:// address (``$XDG_RUNTIME_DIR`` or
    ``/tmp``); None for any other address (an explicit one is the operator's choice)."""
    if (env.get(ADDRESS_ENV) or "").strip() or address != default_address(env, uid):
        return None
    runtime_dir = (env.get("XDG_RUNTIME_DIR") or "").rstrip("/")
    return Path(runtime_dir or "/tmp")


def _levels(root: Path, socket_dir: Path) -> list[Path]:
    """The folders from just below ``root`` down to ``socket_dir``, outermost first."""
    relative = socket_dir.relative_to(root)
    return [root.joinpath(*relative.parts[: i + 1]) for i in range(len(relative.parts))]


def _root_problem(root: Path, uid: int) -> str | None:
    try:
        st = os.stat(root)  # (the root may itself be reached through a symlink, e.g. /tmp -> /private/tmp)
    except OSError as exc:
        return f"socket root {root} cannot be read ({exc.strerror}); set XDG_RUNTIME_DIR or --address"
    if not stat.S_ISDIR(st.st_mode):
        return f"socket root {root} is not a folder; set XDG_RUNTIME_DIR or --address"
    if st.st_uid not in (uid, 0):
        return f"socket root {root} is owned by uid {st.st_uid}, not by you or root; set XDG_RUNTIME_DIR or --address"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"socket root {root} is writable by others (mode {stat.S_IMODE(st.st_mode):o}) without the sticky "
                "bit; set XDG_RUNTIME_DIR or --address to a private folder")
    return None


def _level_problem(level: Path, uid: int) -> str | None:
    """What is wrong with one existing level (None: it is a private folder of ``uid``)."""
    st = os.lstat(level)
    if stat.S_ISLNK(st.st_mode):
        return f"socket folder {level} is a symlink; {FIX}"
    if not stat.S_ISDIR(st.st_mode):
        return f"socket folder {level} is not a folder; {FIX}"
    if st.st_uid != uid:
        return f"socket folder {level} is owned by uid {st.st_uid}, not by you (uid {uid}); {FIX}"
    if st.st_mode & 0o022:
        return f"socket folder {level} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); {FIX}"
    return None


def socket_dir_problem(root: Path, socket_dir: Path, uid: int) -> str | None:
    """One line naming the first unsafe level between ``root`` and ``socket_dir`` (and the fix), or None. A level
    that does not exist ends the walk: nobody controls it yet (the sidecar creates it; a client finds no socket)."""
    problem = _root_problem(root, uid)
    if problem is not None:
        return problem
    for level in _levels(root, socket_dir):
        if not os.path.lexists(level):
            return None
        problem = _level_problem(level, uid)
        if problem is not None:
            return problem
    return None


def ensure_private_dirs(root: Path, socket_dir: Path, uid: int) -> None:
    """Create the missing levels below ``root`` 0700, then check every level; raises ``UnsafeSocketDir``."""
    problem = _root_problem(root, uid)
    if problem is not None:
        raise UnsafeSocketDir(problem)
    for level in _levels(root, socket_dir):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            pass  # (someone's: checked below like one of ours)
        problem = _level_problem(level, uid)
        if problem is not None:
            raise UnsafeSocketDir(problem)


def default_socket_problem(address: str, env: Mapping[str, str], uid: int) -> str | None:
    """A client's check before it connects: when ``address`` is the default ipc:// address, the first unsafe level
    of its path (one line with the fix); None otherwise."""
    root = default_socket_root(address, env, uid)
    if root is None:
        return None
    return socket_dir_problem(root, Path(address[len("ipc://"):]).parent, uid)
