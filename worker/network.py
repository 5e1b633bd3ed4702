"""Free TCP ports on this machine's addresses, for sshd, the rendezvous and torch's store; the address that routes to the master.

A probe only says what is free now: another process may take the port before its user binds it.
Callers on a shared machine (tests, the local backend) accept that small race rather than a fixed
port that collides every time two runs overlap. The race is kept small by probing random ports below the
kernel's ephemeral range (:data:`PROBED_PORTS_FLOOR` up to it): every outgoing connection (ssh, gloo's pairs, an
HTTP client) takes its local port from that range, so none of them can take a probed port in the seconds before a
rank binds it, as one did to torch's store when two launches overlapped.
"""

from __future__ import annotations

import logging
import random
import socket
from pathlib import Path

from worker.errors import WorkerError

logger = logging.getLogger(__name__)

# Above the ports services commonly claim (a notebook server's 8888, TensorBoard's 6006, MLflow's 5000).
PROBED_PORTS_FLOOR = 20000
# The fewest ports worth probing below the ephemeral range; fewer (a machine that lowered the range), and bind(0)
# picks.
PROBED_PORTS_LEAST = 1000
PROBES = 50
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Its own generator: a training process seeds the module-level one, and ranks seeded alike would probe alike.
_chooser = random.SystemRandom()


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``address`` right now, below the ephemeral range where it can
    (:func:`probed_ports`).

    Usage::

        >>> 0 < free_port() < 65536
        True

    :param address: the address to bind (IPv4 or IPv6).
    :rtype: int
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    candidates = probed_ports() or range(0)
    for _ in range(PROBES if candidates else 0):
        port = _chooser.choice(candidates)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def probed_ports(ephemeral_range: Path = EPHEMERAL_RANGE) -> range | None:
    """The ports :func:`free_port` tries: from :data:`PROBED_PORTS_FLOOR` to the start of the kernel's ephemeral
    range; ``None`` where that range is unknown or leaves fewer than :data:`PROBED_PORTS_LEAST`.

    :rtype: range | None
    """
    try:
        ephemeral_low = int(ephemeral_range.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if ephemeral_low - PROBED_PORTS_FLOOR < PROBED_PORTS_LEAST:
        return None
    return range(PROBED_PORTS_FLOOR, ephemeral_low)


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
