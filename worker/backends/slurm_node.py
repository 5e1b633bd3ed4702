"""What a ``slurm`` worker job runs on its node (``python -m worker.backends.slurm_node``): the agent, told what
the allocation says.

- Slots: the GPUs Slurm gave the job on this node (``SLURM_GPUS_ON_NODE``), else 1 (one rank on CPUs).
- Address: the agent's own choice (the interface that routes to the master), as on every platform, except where
  the node's ``NodeAddr`` is a loopback address: several nodes emulated on one host (each ``slurmd -N NAME``
  on its own 127.0.0.x), where every route to the master is the same ``lo`` and only ``NodeAddr`` tells the
  nodes apart, as the ``local`` backend's loopback addresses do.

Then it becomes the agent (``exec``): Slurm signals the agent itself when the job is cancelled.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import subprocess
import sys

from worker import constants as c

logger = logging.getLogger(__name__)


def node_address(node: str) -> str | None:
    """The ``NodeAddr`` of ``node`` as an IP address (``scontrol show node``), or None when Slurm does not say.

    :param node: the node's name (``SLURMD_NODENAME``).
    :rtype: str | None
    """
    try:
        shown = subprocess.run(
            ["scontrol", "show", "node", "--oneliner", node], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        name = next(field.split("=", 1)[1] for field in shown.split() if field.startswith("NodeAddr="))
        return str(socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0])
    except (OSError, subprocess.SubprocessError, StopIteration, IndexError):
        return None


def agent_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the agent's slots, and its address where the node's ``NodeAddr`` is a loopback one.

    :param env: the job's environment.
    :rtype: dict[str, str]
    """
    agent_env = dict(env)
    agent_env.setdefault(c.ENV_SLOTS, env.get("SLURM_GPUS_ON_NODE") or "1")
    address = node_address(env["SLURMD_NODENAME"]) if env.get("SLURMD_NODENAME") else None
    if address is not None and ipaddress.ip_address(address).is_loopback:
        agent_env.setdefault(c.ENV_ADDRESS, address)
    return agent_env


def main() -> None:
    """Become ``python -m worker.agent`` with :func:`agent_environment`."""
    os.execve(sys.executable, [sys.executable, "-m", "worker.agent"], agent_environment(dict(os.environ)))


if __name__ == "__main__":
    main()
