"""The worker agent (``python -m worker.agent``): what each worker pod runs.

1. Reads its settings from the environment the master's backend set (``worker.constants.ENV_*``;
   the token comes from a file or a variable, never from the command line).
2. Finds its own address: ``TEXTSQL_WORKER_ADDRESS``, else the platform's variable
   (``CDSW_IP_ADDRESS`` on CML, ``POD_IP`` on Kubernetes), else the interface that routes to the master.
3. Opens its ranks' heartbeat socket (:class:`worker.beats.BeatInbox`, in a 0700 directory of its own) and starts
   its own sshd with a fresh host key that accepts only the run's client key, naming the socket to its sessions.
4. Registers with the master's rendezvous, retrying with jittered exponential backoff until a deadline.
5. Blocks on the held connection (no polling) until released or the master is gone, relaying its ranks'
   heartbeats on it signed with the pod's key; then stops sshd and exits 0.

SIGTERM and SIGINT stop sshd and exit 0 as well. A refused registration exits 1 with the master's reason.
"""

from __future__ import annotations

import getpass
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from worker import constants as c
from worker.beats import BeatInbox
from worker.constants import DEFAULT_SSH_PORT
from worker.errors import RendezvousError, TextSQLError, WorkerError
from worker.inventory import Inventory, collect, overrides_for
from worker.network import free_port, route_address
from worker.registration import Registration, check_address, check_port, check_slots
from worker.rendezvous.client import parse_endpoint, register_until
from worker.rendezvous.token import read_token
from worker.sshd import Sshd

logger = logging.getLogger(__name__)


class Terminated(Exception):
    """SIGTERM arrived: unwind, stop sshd, exit 0."""


def count_gpus() -> int:
    """GPUs visible to this pod (``nvidia-smi -L``), at least 1 so a CPU pod runs one rank.

    :rtype: int
    """
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(1 for line in listing.splitlines() if line.startswith("GPU ")))


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs, read from its environment."""

    master: tuple[str, int]
    token: str
    address: str
    slots: int
    pod: str
    ssh_port: int  # 0: pick a free one
    client_public_key: str | None
    workdir: Path | None  # None: a private temp dir, removed on exit with the sshd host key in it
    deadline_s: float
    sshd: bool
    inventory: Inventory
    sshd_keys_dir: Path | None = None  # None: the home directory (see worker.sshd.Sshd)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgentConfig:
        """Read and check the agent's settings.

        :param env: usually ``os.environ``.
        :rtype: AgentConfig
        :raises TextSQLError: naming the variable to set.
        """
        if not env.get(c.ENV_RENDEZVOUS):
            raise RendezvousError(f"{c.ENV_RENDEZVOUS} is not set; the master's backend sets it to HOST:PORT")
        master = parse_endpoint(env[c.ENV_RENDEZVOUS])
        if env.get(c.ENV_TOKEN_FILE):
            group = env.get(c.ENV_TOKEN_GROUP)
            token = read_token(Path(env[c.ENV_TOKEN_FILE]), group=int(group) if group and group.isdigit() else None)
        elif env.get(c.ENV_TOKEN):
            token = env[c.ENV_TOKEN]
        else:
            raise RendezvousError(f"set {c.ENV_TOKEN_FILE} (or {c.ENV_TOKEN}) to the run's rendezvous token")
        sshd = env.get(c.ENV_SSHD, "1") != "0"
        if sshd and not env.get(c.ENV_CLIENT_PUBKEY):
            raise WorkerError(f"{c.ENV_CLIENT_PUBKEY} is not set; pass the run's id_ed25519.pub")
        address = env.get(c.ENV_ADDRESS) or next((env[v] for v in c.PLATFORM_ADDRESS_VARS if env.get(v)), None)
        try:
            slots = int(env[c.ENV_SLOTS]) if env.get(c.ENV_SLOTS) else count_gpus()
            port = int(env.get(c.ENV_SSH_PORT, DEFAULT_SSH_PORT))
            deadline = float(env.get(c.ENV_DEADLINE, c.REGISTER_DEADLINE_S))
        except ValueError as error:
            raise WorkerError(f"bad number in the agent's environment: {error}") from None
        address = check_address(address or route_address(master[0]))
        pod = env.get(c.ENV_POD) or next((env[v] for v in c.PLATFORM_POD_VARS if env.get(v)), socket.gethostname())
        return cls(
            master=master,
            token=token,
            address=address,
            slots=check_slots(slots),
            pod=pod,
            ssh_port=port if port == 0 else check_port(port),
            client_public_key=env.get(c.ENV_CLIENT_PUBKEY),
            workdir=Path(env[c.ENV_WORKER_DIR]) if env.get(c.ENV_WORKER_DIR) else None,
            deadline_s=deadline,
            sshd=sshd,
            # Free disk where the ranks run (pdsh starts them in the project directory, as the agent is).
            inventory=collect(address, Path.cwd(), overrides_for(pod, env.get(c.ENV_INVENTORY_OVERRIDES))),
            sshd_keys_dir=Path(env[c.ENV_SSHD_KEYS_DIR]) if env.get(c.ENV_SSHD_KEYS_DIR) else None,
        )


def _start_sshd(config: AgentConfig, workdir: Path, beats: BeatInbox) -> Sshd:
    # With port 0, another process may take the port between our probe and sshd's bind: try again.
    assert config.client_public_key is not None  # from_env requires it where sshd runs
    failure: WorkerError | None = None
    for _ in range(3 if config.ssh_port == 0 else 1):
        port = config.ssh_port or free_port(config.address)
        try:
            return Sshd(
                workdir / "sshd",
                config.address,
                port,
                config.client_public_key,
                env=_session_env(config) | {c.ENV_BEAT_SOCKET: beats.path},
                keys_dir=config.sshd_keys_dir,
            ).start()
        except WorkerError as error:
            failure = error
    assert failure is not None  # the loop ran at least once
    raise failure


def _session_env(config: AgentConfig) -> dict[str, str]:
    """The agent's environment for ssh sessions, with NCCL and gloo on the interface carrying this pod's address."""
    interface = {name: config.inventory.interface for name in c.SOCKET_IFNAME_VARS if config.inventory.interface}
    return interface | dict(os.environ)


def _loopback_source(address: str, master_host: str) -> str | None:
    # Local workers connect from their own 127.0.0.x, as pods do from their own IP, so the master's
    # per-address limit on unauthenticated connections sees one worker per address there too.
    try:
        own, master = ipaddress.ip_address(address), ipaddress.ip_address(master_host)
    except ValueError:
        return None
    return address if own.is_loopback and master.is_loopback and own.version == master.version else None


def run(config: AgentConfig) -> bool:
    """Start sshd (unless register-only), register, wait for release; always stop sshd.

    :param config: the agent's settings.
    :rtype: bool
    :returns: True when released by the master, False when the master went away.
    """
    with ExitStack() as stack:
        workdir = config.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="textsql-worker-")))
        beats = stack.enter_context(BeatInbox())
        sshd = stack.enter_context(_start_sshd(config, workdir, beats)) if config.sshd else None
        # Runs on the way out, just before sshd's stop: the SIGTERM that follows a release (the backend stopping
        # its pods) must not cut that stop short and orphan sshd.
        stack.callback(signal.signal, signal.SIGTERM, signal.SIG_IGN)
        registration = Registration(
            address=config.address,
            slots=config.slots,
            hostname=socket.gethostname(),
            pod=config.pod,
            ssh_port=sshd.port if sshd else None,
            host_key=sshd.host_public_key if sshd else None,
            user=getpass.getuser(),
            inventory=config.inventory,
        )
        session = stack.enter_context(
            register_until(
                config.master,
                config.token,
                registration,
                config.deadline_s,
                source=_loopback_source(config.address, config.master[0]),
            )
        )
        logger.info(
            "registered %s (pod %s, %d slots) with %s:%d; waiting for release",
            config.address,
            config.pod,
            config.slots,
            *config.master,
        )
        released = session.wait_released(beats=beats)
        logger.info("released by the master" if released else "the master is gone; shutting down")
        return released


def _terminate(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM must not interrupt the shutdown this one starts.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(signal.Signals(signum).name)


def main() -> int:
    """Entry point of ``python -m worker.agent``.

    :rtype: int
    """
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s worker.agent[%(process)d]: %(message)s",
        datefmt="%H:%M:%S",
    )
    signal.signal(signal.SIGTERM, _terminate)
    try:
        run(AgentConfig.from_env(os.environ))
    except (Terminated, KeyboardInterrupt):
        logger.info("stopping on signal")
    except TextSQLError as error:
        logger.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
