"""Free TCP ports on this machine's addresses, for sshd, the rendezvous and torch's store; the address that routes to the master.

A probe only says what is free now: another process may take the port before its user binds it.
Callers on a shared machine (tests, the local backend) accept that small race rather than a fixed
port that collides every time two runs overlap.
"""

from __future__ import annotations

import logging
import socket

from worker.errors import WorkerError

logger = logging.getLogger(__name__)


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``address`` right now.

    Usage::

        >>> 0 < free_port() < 65536
        True

    :param address: the address to bind (IPv4 or IPv6).
    :rtype: int
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_on_all(addresses: list[str], attempts: int = 20) -> int:
    """A TCP port that is free on every address right now.

    :param addresses: addresses that must all be able to bind it.
    :param attempts: candidate ports to try.
    :rtype: int
    :raises WorkerError: when no candidate was free everywhere.
    """
    for _ in range(attempts):
        port = free_port(addresses[0])
        sockets = []
        try:
            for address in addresses:
                sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind((address, port))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise WorkerError(f"found no port free on all of {addresses[0]}..{addresses[-1]}; pass ssh_port=")


def route_address(master_host: str) -> str:
    """The local address of the interface that routes to ``master_host`` (no packet is sent).

    :param master_host: the master's address or name.
    :rtype: str
    """
    family = socket.AF_INET6 if ":" in master_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master_host, 9))  # UDP connect only picks a route
        address: str = probe.getsockname()[0]
        return address
