"""Honest workers register while one address floods the rendezvous with idle connections.

The attack stays on loopback: the attacker connects from 127.0.0.66, the honest workers from
127.0.0.2..4, the server listens on 127.0.0.1. It opens at most ``ATTACK_CONNECTIONS`` connections
at up to about 1,000 a second, holds them silently, and stops by itself after ``FLOOD_S`` seconds.
"""

from __future__ import annotations

import base64
import logging
import secrets
import socket
import struct
import threading
import time

import pytest

from worker.registration import Registration
from worker.rendezvous.client import register
from worker.rendezvous.server import RendezvousServer
from worker.runfiles import RunFiles

TOKEN = secrets.token_urlsafe(32)
ATTACKER = "127.0.0.66"
HONEST = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
ATTACK_CONNECTIONS = 1500  # the flood was ~530 from one address; 3x that, against a 512 cap
FLOOD_S = 12.0


def registration(address: str, seed: int) -> Registration:
    blob = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32) + seed.to_bytes(32, "big")
    return Registration(
        address=address,
        slots=1,
        hostname=f"pod-{seed}",
        pod=f"pod-{seed}",
        ssh_port=2222,
        host_key=f"ssh-ed25519 {base64.b64encode(blob).decode()}",
        user="root",
    )


class Flood(threading.Thread):
    """Opens up to ``limit`` silent connections from one address, holds them, and closes all after ``duration``."""

    def __init__(self, endpoint: tuple[str, int], limit: int, duration: float) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.limit, self.duration = endpoint, limit, duration
        self.opened = 0
        self.started_flooding = threading.Event()

    def run(self) -> None:
        held: list[socket.socket] = []
        end = time.monotonic() + self.duration
        try:
            while time.monotonic() < end:
                if self.opened < self.limit:
                    try:
                        held.append(socket.create_connection(self.endpoint, timeout=1, source_address=(ATTACKER, 0)))
                        self.opened += 1
                    except OSError:
                        pass
                    if self.opened >= 600:  # past the 512 connections the server serves at once
                        self.started_flooding.set()
                time.sleep(0.001)
        finally:
            self.started_flooding.set()
            for sock in held:
                sock.close()


@pytest.mark.slow
def test_honest_workers_register_during_a_flood_from_one_address(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="worker")
    with RendezvousServer(expect=len(HONEST), token=TOKEN, files=RunFiles.in_dir(tmp_path)) as server:
        flood = Flood(server.endpoint, ATTACK_CONNECTIONS, FLOOD_S)
        flood.start()
        assert flood.started_flooding.wait(timeout=10)
        started = time.monotonic()
        sessions = [
            register(server.endpoint, TOKEN, registration(address, i), timeout=5, source=address)
            for i, address in enumerate(HONEST)
        ]
        workers = server.wait(timeout=5)
        took = time.monotonic() - started
        assert flood.is_alive(), "the flood ended before the workers registered: the test proved nothing"
        for session in sessions:
            session.close()
        flood.join()
    assert [w.address for w in workers] == HONEST
    assert took < 5
    assert flood.opened >= 600, flood.opened
    refusals = [
        r
        for r in caplog.records
        if r.name.startswith("worker.rendezvous")
        and ("refusing" in r.getMessage() or "dropped before registering" in r.getMessage())
    ]
    # One line per kind per 5 s, not one per connection.
    assert len(refusals) <= 2 * (1 + FLOOD_S / 5), [r.getMessage() for r in refusals]
