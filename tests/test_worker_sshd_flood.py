"""A flood of idle connections against a worker's sshd does not lock the master out (real sshd, real ssh).

The attacker is any address that reaches port 2222 (on Kubernetes, any pod): here 127.0.0.66 on
loopback. It keeps up to ``HELD`` silent connections open to one worker's sshd, reopening each one
sshd drops, at most ``RATE`` a second, for ``FLOOD_S`` seconds, and needs no key or token.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.slow
ATTACKER = "127.0.0.66"
HELD = 128  # the flood: 128 idle connections, reopened as dropped
RATE = 200  # new connections a second at most
FLOOD_S = 30.0


class SshdFlood(threading.Thread):
    """Holds up to ``HELD`` idle connections to ``endpoint`` from one address until stopped."""

    def __init__(self, endpoint: tuple[str, int]) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.opened = 0
        self.most_held = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        held: list[socket.socket] = []
        end = time.monotonic() + FLOOD_S
        try:
            while time.monotonic() < end and not self.stopping.is_set():
                readable, _, _ = select.select(held, [], [], 0) if held else ([], [], [])
                for sock in readable:
                    try:
                        data = sock.recv(4096)  # sshd's banner, or b"" once it dropped us
                    except OSError:
                        data = b""
                    if not data:
                        held.remove(sock)
                        sock.close()
                if len(held) < HELD:
                    try:
                        held.append(socket.create_connection(self.endpoint, timeout=1, source_address=(ATTACKER, 0)))
                        self.opened += 1
                    except OSError:
                        pass
                self.most_held = max(self.most_held, len(held))
                time.sleep(1 / RATE)
        finally:
            for sock in held:
                sock.close()


def test_the_master_reaches_a_worker_while_one_address_floods_its_sshd(two_local_workers):
    cluster = two_local_workers
    host = cluster.hosts[0]
    flood = SshdFlood((host, cluster.workers[0].ssh_port))
    flood.start()
    try:
        time.sleep(8)  # long enough for the flood to fill sshd's unauthenticated slots where it can
        results = [cluster.ssh(host, "true", timeout=30).returncode for _ in range(5)]
        assert flood.is_alive(), "the flood ended before the checks: the test proved nothing"
        answered = cluster.answers(host)
    finally:
        flood.stopping.set()
        flood.join()
    print(f"flood: {flood.opened} connections opened, at most {flood.most_held} held at once; ssh exits {results}")
    assert results == [0] * 5 and answered


def test_the_master_tries_ssh_again_before_it_calls_a_worker_lost(two_local_workers, caplog):
    """One failed ssh (here: the run's ssh_config names a dead port until a moment later) is not a lost worker."""
    cluster = two_local_workers
    config = cluster.ssh_config.read_text()
    port = cluster.workers[0].ssh_port
    cluster.ssh_config.write_text(config.replace(f"Port {port}", "Port 1", 1))
    threading.Timer(1.0, cluster.ssh_config.write_text, args=(config,)).start()
    assert cluster.answers(cluster.hosts[0])
    assert "ssh to 127.0.0.2 failed (attempt 1 of 3)" in caplog.text
    cluster.ssh_config.write_text(config.replace(f"Port {port}", "Port 1", 1))
    assert not cluster.answers(cluster.hosts[0], attempts=2)
    cluster.ssh_config.write_text(config)
