"""The default socket path on a shared host (issue 47, item 2): every folder level below the trusted root
(``$XDG_RUNTIME_DIR`` or ``/tmp``) must be a real folder of the sidecar's user that nobody else can write; the
sidecar refuses a hostile layout with one line naming the folder and the fix, and so does a client before it
connects to the default address. Hostile layouts are built here: a 0777 level, a symlinked level, a level owned by
another user (needs root: chown to nobody), a world-writable root without the sticky bit."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from code2wav.proto.address import default_address
from code2wav.proto import socket_dir as checks
from code2wav.proto.socket_dir import default_socket_problem, default_socket_root
from code2wav.sidecar.transport import UnsafeSocketDir, ensure_private_dirs
from conftest import ROOT, TINY

NOBODY_UID = 65534
UID = os.getuid()


def socket_dir_problem(root, socket_dir, uid):
    """The client's check (``os.stat`` is its only I/O)."""
    return checks.socket_dir_problem(str(root), str(socket_dir), uid, os.stat)


def _layout(tmp_path):
    """A private trusted root and the default levels below it: ``root/code2wav-sidecar-<uid>/code2wav``."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    outer = root / f"code2wav-sidecar-{UID}"
    return root, outer, outer / "code2wav"


def test_fresh_levels_are_created_private(tmp_path):
    root, outer, inner = _layout(tmp_path)
    ensure_private_dirs(str(root), str(inner), UID)
    for level in (outer, inner):
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700 and os.lstat(level).st_uid == UID
    assert socket_dir_problem(root, inner, UID) is None
    ensure_private_dirs(str(root), str(inner), UID)  # existing private levels are accepted as they are


def test_a_0777_level_is_refused_with_the_path_and_the_fix(tmp_path):
    root, outer, inner = _layout(tmp_path)
    outer.mkdir()
    os.chmod(outer, 0o777)  # squatted first, open to everyone
    with pytest.raises(UnsafeSocketDir) as caught:
        ensure_private_dirs(str(root), str(inner), UID)
    message = str(caught.value)
    assert f"socket folder {outer} is writable by others (mode 777)" in message and "remove it" in message
    assert "\n" not in message
    assert not inner.exists()  # nothing created below a refused level
    assert socket_dir_problem(root, inner, UID) == message  # the client's check says the same


def test_a_group_writable_inner_level_is_refused(tmp_path):
    root, outer, inner = _layout(tmp_path)
    ensure_private_dirs(str(root), str(inner), UID)
    os.chmod(inner, 0o770)
    assert f"socket folder {inner} is writable by others (mode 770)" in socket_dir_problem(root, inner, UID)


def test_a_symlinked_level_is_refused(tmp_path):
    root, outer, inner = _layout(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / "code2wav").mkdir(mode=0o700)
    outer.symlink_to(elsewhere)  # moved aside and replaced by a link: every level below looks fine through it
    with pytest.raises(UnsafeSocketDir, match=f"socket folder {outer} is a symlink"):
        ensure_private_dirs(str(root), str(inner), UID)
    assert "is a symlink" in socket_dir_problem(root, inner, UID)


@pytest.mark.skipif(UID != 0, reason="a folder owned by another user can only be made by root (chown to nobody)")
def test_a_level_owned_by_another_user_is_refused_even_for_root(tmp_path):
    root, outer, inner = _layout(tmp_path)
    ensure_private_dirs(str(root), str(inner), UID)
    os.chown(inner, NOBODY_UID, -1)  # mode 0700, but another user's: they could bind their own socket in it
    assert stat.S_IMODE(os.lstat(inner).st_mode) == 0o700
    with pytest.raises(UnsafeSocketDir, match=f"socket folder {inner} is owned by uid {NOBODY_UID}, not by you"):
        ensure_private_dirs(str(root), str(inner), UID)


def test_the_root_must_be_sticky_when_others_may_write(tmp_path):
    root, outer, inner = _layout(tmp_path)
    os.chmod(root, 0o777)
    assert "writable by others (mode 777) without the sticky bit" in socket_dir_problem(root, inner, UID)
    os.chmod(root, 0o1777)  # /tmp's mode: nobody may rename another's folder inside it
    assert socket_dir_problem(root, inner, UID) is None


def test_only_the_default_address_is_walked(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    address = default_address(env, UID)
    assert default_socket_root(address, env, UID) == str(tmp_path)
    assert default_socket_root(address, {}, UID) is None  # not the default without XDG_RUNTIME_DIR
    assert default_socket_root(f"ipc://{tmp_path}/other.sock", env, UID) is None  # an explicit address
    explicit = {**env, "CODE2WAV_SIDECAR_ADDRESS": address}
    assert default_socket_root(address, explicit, UID) is None  # the operator named it
    assert default_socket_root(default_address({}, UID), {}, UID) == "/tmp"
    assert default_socket_problem("tcp://127.0.0.1:5555", env, UID, os.stat) is None
    with pytest.raises(ValueError, match="is not below"):
        checks.socket_levels("/tmp/a", "/tmp/a/../b")


def _default_env(xdg) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CODE2WAV_SIDECAR_ADDRESS"}
    return {**env, "XDG_RUNTIME_DIR": str(xdg), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _serve_default(xdg, timeout_s: float = 60):
    return subprocess.run([sys.executable, "-m", "code2wav.sidecar", "serve", "--model", str(TINY), "--device", "cpu",
                           "--metrics-port", "0", "--max-streams", "4"], capture_output=True, text=True, cwd=ROOT,
                          env=_default_env(xdg), timeout=timeout_s)


def test_serve_refuses_a_squatted_default_folder(tmp_path):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    (xdg / "code2wav").mkdir()
    os.chmod(xdg / "code2wav", 0o777)
    proc = _serve_default(xdg)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: cannot use ipc://{xdg}/code2wav/sidecar.sock: socket folder {xdg}/code2wav is "
                     "writable by others (mode 777); remove it (ask its owner or an admin if it is not yours), or "
                     "set XDG_RUNTIME_DIR or --address / $CODE2WAV_SIDECAR_ADDRESS to a folder only you can write"]


@pytest.mark.skipif(UID != 0, reason="a folder owned by another user can only be made by root (chown to nobody)")
def test_root_serve_refuses_another_users_private_folder(tmp_path):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    (xdg / "code2wav").mkdir(mode=0o700)
    os.chown(xdg / "code2wav", NOBODY_UID, NOBODY_UID)
    proc = _serve_default(xdg)
    assert proc.returncode == 2 and f"socket folder {xdg}/code2wav is owned by uid {NOBODY_UID}" in proc.stderr


def test_client_refuses_a_squatted_default_folder(tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir(mode=0o700)
    (xdg / "code2wav").symlink_to(elsewhere)
    monkeypatch.delenv("CODE2WAV_SIDECAR_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    with pytest.raises(cerr.InvalidArgument, match=f"socket folder {xdg}/code2wav is a symlink"):
        SidecarClient(connect_timeout_s=1)


def test_default_address_works_end_to_end_when_private(tmp_path, monkeypatch):
    """The check refuses nothing it should accept: ``serve`` with no --address creates the folder 0700 under
    $XDG_RUNTIME_DIR and a client with no address reaches it."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "code2wav.sidecar", "serve", "--model", str(TINY), "--device",
                                 "cpu", "--metrics-port", "0", "--max-streams", "4"], stdout=subprocess.PIPE,
                                stderr=log_file, text=True, cwd=ROOT, env=_default_env(xdg))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not proc.stdout.readline().startswith("code2wav-sidecar ready:"):
            assert proc.poll() is None, log_path.read_text()
        assert stat.S_IMODE(os.lstat(xdg / "code2wav").st_mode) == 0o700
        monkeypatch.delenv("CODE2WAV_SIDECAR_ADDRESS", raising=False)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
        with SidecarClient(connect_timeout_s=30) as client:
            assert client.address == f"ipc://{xdg}/code2wav/sidecar.sock"
            info = client.server_info.models[0]
            audio = client.open_stream("s").decode(torch.zeros(info.num_quantizers, 2, dtype=torch.long))
            assert audio.numel() == 2 * info.samples_per_frame
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
