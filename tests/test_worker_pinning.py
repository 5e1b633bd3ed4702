"""Host-key pinning holds against hostile addresses: real ssh, a real impostor sshd, the run's own files.

Also: IPv4 and IPv6 workers together give one hostfile in a defined order (no TypeError, no hang).
"""

from __future__ import annotations

import base64
import secrets
import struct
import subprocess

import pytest

from worker.registration import InvalidRegistration, Registration, check_address
from worker.rendezvous.client import register
from worker.rendezvous.server import RendezvousServer
from worker.runfiles import RunFiles, format_known_hosts, write_run_files

TOKEN = secrets.token_urlsafe(32)
WILDCARD = "fe80::1%x,*"  # OpenSSH reads "a,*" in known_hosts as a pattern list: "*" matches every host


def host_key(seed: int) -> str:
    blob = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32) + seed.to_bytes(32, "big")
    return f"ssh-ed25519 {base64.b64encode(blob).decode()}"


def fields(address: str, key: str, pod: str, port: int = 2222) -> dict:
    return {
        "address": address,
        "slots": 1,
        "hostname": pod,
        "pod": pod,
        "ssh_port": port,
        "host_key": key,
        "user": "root",
    }


@pytest.mark.parametrize(
    "address",
    [
        WILDCARD,
        "fe80::1%eth0",
        "*",
        "127.0.0.2,*",
        "[::1]",
        "::1 ",
        "10.0.0.1?",
        "!10.0.0.1",
        "fe80::1%x]:22 *",
    ],
)
def test_addresses_openssh_could_read_as_patterns_are_refused(address):
    with pytest.raises(InvalidRegistration, match="address"):
        check_address(address)


def test_a_registration_that_skipped_validation_cannot_reach_known_hosts():
    forged = Registration(address=WILDCARD, slots=1, hostname="x", pod="x", ssh_port=22, host_key=host_key(1))
    with pytest.raises(InvalidRegistration, match="address"):
        format_known_hosts([forged])


@pytest.mark.slow
def test_a_wildcard_registration_does_not_make_ssh_trust_an_impostor(loopback_sshd, tmp_path):
    """The attacker holds the token, registers its own key under a pattern address, then answers for 127.0.0.2."""
    impostor, identity = loopback_sshd  # accepts the run's client key: only the host key check can stop ssh
    honest = Registration.from_dict(fields("127.0.0.2", host_key(7), "honest", impostor.port))
    try:
        attacker = Registration.from_dict(fields(WILDCARD, impostor.host_public_key, "attacker", impostor.port))
    except InvalidRegistration:  # the best it can do now: pin its key to an address of its own
        attacker = Registration.from_dict(fields("127.0.0.9", impostor.host_public_key, "attacker", impostor.port))
    (tmp_path / "run").mkdir()
    files = write_run_files(RunFiles.in_dir(tmp_path / "run"), [honest, attacker], identity)
    result = subprocess.run(
        ["ssh", "-F", str(files.ssh_config), "127.0.0.2", "true"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 255 and "Host key verification failed" in result.stderr, (
        result.returncode,
        result.stderr,
    )


def test_ipv4_and_ipv6_workers_give_a_hostfile_in_a_defined_order(tmp_path):
    files = RunFiles.in_dir(tmp_path)
    addresses = ["10.0.0.2", "::1", "10.0.0.1", "fd00::2"]
    with RendezvousServer(expect=len(addresses), token=TOKEN, files=files) as server:
        sessions = [
            register(server.endpoint, TOKEN, Registration.from_dict(fields(a, host_key(i), f"pod-{i}")))
            for i, a in enumerate(addresses)
        ]
        workers = server.wait(timeout=10)
        for session in sessions:
            session.close()
    assert [w.address for w in workers] == ["10.0.0.1", "10.0.0.2", "::1", "fd00::2"]
    assert files.hostfile.read_text() == "10.0.0.1 slots=1\n10.0.0.2 slots=1\n::1 slots=1\nfd00::2 slots=1\n"
