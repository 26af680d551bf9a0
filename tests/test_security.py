"""Security defaults: private ipc socket, loopback-only TCP unless CurveZMQ or --insecure, keys never logged."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest
import zmq.auth

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from conftest import ROOT, TINY
from code2wav.loadgen.spawn import spawn_sidecar


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "code2wav.sidecar", "serve", "--model", str(TINY), "--device", "cpu",
                           "--metrics-port", "0", "--max-streams", "4", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)


def test_ipc_socket_is_private(sidecar):
    path = sidecar.address[len("ipc://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_non_loopback_tcp_refused_without_curve_or_insecure(tmp_path):
    proc = _serve(tmp_path, "--address", f"tcp://0.0.0.0:{_free_port()}")
    assert proc.returncode == 2
    assert "refusing to bind" in proc.stderr and "--insecure" in proc.stderr and "keygen" in proc.stderr


def test_loopback_tcp_is_allowed(tmp_path, golden_cases):
    running = spawn_sidecar("--model", str(TINY), "--device", "cpu", "--address", f"tcp://127.0.0.1:{_free_port()}",
                            workdir=tmp_path)
    try:
        with SidecarClient(running.address) as client:
            assert client.open_stream("t").decode(golden_cases["codes"][0, :, :2]).numel() == 96
    finally:
        running.stop()


def test_insecure_flag_binds_with_a_warning(tmp_path):
    running = spawn_sidecar("--model", str(TINY), "--device", "cpu", "--address", f"tcp://0.0.0.0:{_free_port()}",
                            "--insecure", workdir=tmp_path)
    try:
        with SidecarClient(running.address.replace("0.0.0.0", "127.0.0.1")) as client:
            assert client.ping() >= 0
        assert "SECURITY" in running.log() and "WITHOUT encryption" in running.log()
    finally:
        running.stop()


def test_curve_encrypted_tcp(tmp_path, golden_cases):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "code2wav.sidecar", "keygen", str(keys)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    public, secret = zmq.auth.load_certificate(str(keys / "server.key_secret"))
    port = _free_port()
    running = spawn_sidecar("--model", str(TINY), "--device", "cpu", "--address", f"tcp://0.0.0.0:{port}",
                            "--curve-secret-key-file", str(keys / "server.key_secret"), workdir=tmp_path)
    address = f"tcp://127.0.0.1:{port}"
    try:
        with SidecarClient(address, curve_server_key=public) as client:
            assert client.open_stream("c").decode(golden_cases["codes"][0, :, :2]).numel() == 96
        with pytest.raises(cerr.Unavailable):
            SidecarClient(address, connect_timeout_s=1.5)  # no key: the handshake never completes
        wrong_public, _ = zmq.curve_keypair()
        with pytest.raises(cerr.Unavailable):
            SidecarClient(address, connect_timeout_s=1.5, curve_server_key=wrong_public)
        log = running.log()
        assert secret.decode() not in log and public.decode() not in log  # keys never logged
        assert secret.decode() not in running.scrape()
    finally:
        running.stop()
