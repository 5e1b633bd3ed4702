"""The weaker points of the attack pass: deep nesting, an IPv6 worker's default name, the workers' sshd."""

from __future__ import annotations

import json
import logging
import secrets
import socket
import struct
import subprocess

import pytest

from worker.protocol import new_nonce, recv_frame
from worker.registration import Registration, registration_from_options
from worker.rendezvous.server import RendezvousServer
from worker.runfiles import RunFiles, write_run_files

TOKEN = secrets.token_urlsafe(32)


def test_a_registration_nested_5000_deep_is_one_line_refusal_without_a_traceback(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="worker")
    depth = 5000
    body = json.dumps({"type": "register", "nonce": new_nonce(), "mac": "00"})[:-1]
    body += ', "worker": ' + "[" * depth + "]" * depth + "}"
    with (
        RendezvousServer(expect=1, token=TOKEN, files=RunFiles.in_dir(tmp_path)) as server,
        socket.create_connection(server.endpoint, timeout=10) as sock,
    ):
        recv_frame(sock)
        sock.sendall(struct.pack(">I", len(body)) + body.encode())
        assert sock.recv(4096) == b""  # closed without an answer
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert [r.getMessage() for r in caplog.records if "nests deeper" in r.getMessage()] == [
        "connection from 127.0.0.1 dropped before registering: frame body nests deeper than 8 levels"
    ]


def test_register_with_an_ipv6_address_builds_a_valid_default_pod_name():
    assert registration_from_options("::1", 1).pod == "ipv6-::1"
    assert registration_from_options("10.0.0.2", 1).pod == "10.0.0.2"


@pytest.fixture
def worker_sshd(loopback_sshd, tmp_path):
    """A worker's sshd under /tmp (where StrictModes once had to be off), and the run's files for it."""
    sshd, identity = loopback_sshd
    registration = Registration(
        address="127.0.0.2",
        slots=1,
        hostname="w",
        pod="w",
        ssh_port=sshd.port,
        host_key=sshd.host_public_key,
        user="root",
    )
    (tmp_path / "run").mkdir()
    return sshd, write_run_files(RunFiles.in_dir(tmp_path / "run"), [registration], identity)


@pytest.mark.slow
def test_worker_sshd_runs_strict_modes_and_refuses_stream_local_forwarding(worker_sshd, tmp_path):
    sshd, files = worker_sshd
    config = (sshd.workdir / "sshd_config").read_text()
    assert "StrictModes yes\n" in config and "AllowStreamLocalForwarding no\n" in config
    ssh = ["ssh", "-F", str(files.ssh_config)]
    login = subprocess.run([*ssh, "127.0.0.2", "echo ok"], check=False, capture_output=True, text=True, timeout=30)
    assert login.returncode == 0 and login.stdout == "ok\n", login.stderr
    forward = subprocess.run(
        [*ssh, "-o", "ExitOnForwardFailure=yes", "-R", f"{tmp_path}/fwd.sock:127.0.0.1:9", "127.0.0.2", "true"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert forward.returncode == 255 and "forwarding failed" in forward.stderr, (forward.returncode, forward.stderr)
