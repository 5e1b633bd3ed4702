"""Free-port probes (worker.network): the port is bindable where it was probed, and lies where no outgoing
connection takes its local port."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from worker.errors import WorkerError
from worker.network import EPHEMERAL_RANGE, PROBED_PORTS_FLOOR, free_port, free_port_on_all, probed_ports


def test_free_port_can_be_bound_on_its_address():
    for address in ("127.0.0.1", "127.0.0.2"):
        port = free_port(address)
        with socket.socket() as sock:
            sock.bind((address, port))


def test_free_port_on_all_is_free_on_every_address():
    addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = free_port_on_all(addresses)
    sockets = [socket.socket() for _ in addresses]
    try:
        for sock, address in zip(sockets, addresses):
            sock.bind((address, port))
    finally:
        for sock in sockets:
            sock.close()


def test_no_common_port_is_an_error_that_says_what_to_pass(monkeypatch):
    def taken(self, address):
        raise OSError(98, "Address already in use")

    port = free_port("127.0.0.2")
    monkeypatch.setattr("worker.network.free_port", lambda address: port)
    monkeypatch.setattr(socket.socket, "bind", taken)
    with pytest.raises(WorkerError, match="pass ssh_port="):
        free_port_on_all(["127.0.0.2", "127.0.0.3"], attempts=2)


@pytest.mark.skipif(not EPHEMERAL_RANGE.is_file(), reason="no /proc/sys/net/ipv4/ip_local_port_range here")
def test_a_probed_port_lies_below_the_range_outgoing_connections_take_their_ports_from():
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = [free_port("127.0.0.2") for _ in range(20)]
    assert all(PROBED_PORTS_FLOOR <= port < ephemeral_low for port in ports), ports
    with socket.socket() as client:
        client.bind(("127.0.0.2", 0))  # the local port connect() takes
        assert client.getsockname()[1] >= ephemeral_low


def test_the_probed_range_is_read_from_the_kernel_and_left_to_bind_0_when_too_small(tmp_path: Path):
    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")
    assert probed_ports(ephemeral) == range(PROBED_PORTS_FLOOR, 32768)
    ephemeral.write_text(f"{PROBED_PORTS_FLOOR + 10}\t60999\n")
    assert probed_ports(ephemeral) is None
    assert probed_ports(tmp_path / "absent") is None


def test_processes_seeded_alike_still_probe_different_ports():
    """A training process seeds Python's random module (42 by default): the probe draws from its own generator."""
    picks = []
    for _ in range(2):
        random.seed(42)
        picks.append([free_port() for _ in range(4)])
    assert picks[0] != picks[1]
