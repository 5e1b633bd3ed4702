"""Free-port probes (worker.network): the port is bindable where it was probed."""

from __future__ import annotations

import socket

import pytest

from worker.errors import WorkerError
from worker.network import free_port, free_port_on_all


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
