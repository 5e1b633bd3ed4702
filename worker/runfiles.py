"""The files a run's ssh and DeepSpeed's launcher read: hostfile, known_hosts and ssh_config.

They are built only from authenticated registrations, so ``StrictHostKeyChecking yes`` holds for
every worker: no trust-on-first-use, no ``StrictHostKeyChecking no``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.constants import HOSTFILE_NAME, KNOWN_HOSTS_NAME, SSH_CONFIG_NAME
from worker.files import atomic_write, private_dir
from worker.hostfile import format_hostfile
from worker.registration import Registration, check_address
from worker.ssh import ssh_settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunFiles:
    """Where one run's files live."""

    hostfile: Path
    known_hosts: Path
    ssh_config: Path

    @classmethod
    def in_dir(cls, directory: Path) -> RunFiles:
        """The standard names inside ``directory``.

        :param directory: the run dir (or the hostfile's directory).
        :rtype: RunFiles
        """
        directory = Path(directory).resolve()
        return cls(directory / HOSTFILE_NAME, directory / KNOWN_HOSTS_NAME, directory / SSH_CONFIG_NAME)

    @classmethod
    def cleared(cls, directory: Path) -> RunFiles:
        """The standard names inside ``directory``, made private (0700: the run's key, token and ssh files are for
        the user who started it), with none of an earlier run's files left: a failed start must not leave an
        older run's hostfile behind.

        :rtype: RunFiles
        """
        private_dir(directory)
        files = cls.in_dir(directory)
        for stale in (files.hostfile, files.known_hosts, files.ssh_config):
            stale.unlink(missing_ok=True)
        return files


def known_hosts_pattern(address: str, port: int) -> str:
    """How OpenSSH names ``address:port`` in known_hosts: bare for port 22, ``[address]:port`` otherwise.

    :param address: the worker's address; checked again here, since a pattern (``*``, ``a,b``, a scope id)
        in known_hosts would pin the key to hosts other than this one.
    :param port: its sshd port.
    :rtype: str
    :raises InvalidRegistration: if ``address`` is not a plain IP address.
    """
    address = check_address(address)
    return address if port == 22 else f"[{address}]:{port}"


def format_known_hosts(workers: Sequence[Registration]) -> str:
    """One known_hosts line per worker that runs sshd.

    :param workers: registrations.
    :rtype: str
    """
    return "".join(
        f"{known_hosts_pattern(w.address, w.ssh_port)} {w.host_key}\n"
        for w in workers
        if w.host_key and w.ssh_port is not None
    )


def format_ssh_config(workers: Sequence[Registration], identity_file: Path | None, known_hosts: Path) -> str:
    """An ssh_config with one ``Host`` block per worker that runs sshd.

    Used as ``ssh -F ssh_config ADDRESS`` and by pdsh through ``PDSH_SSH_ARGS_APPEND="-F ssh_config"``.

    :param workers: registrations.
    :param identity_file: the run's private key (None: ssh's default identities).
    :param known_hosts: the run's known_hosts file.
    :rtype: str
    """
    blocks = []
    for worker in workers:
        if not worker.host_key:
            continue
        address = check_address(worker.address)
        settings = ssh_settings(
            port=worker.ssh_port, user=worker.user, identity_file=identity_file, known_hosts=known_hosts
        )
        lines = [f"Host {address}", f"    HostName {address}"]
        lines += [f"    {name} {value}" for name, value in settings.items()]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def write_run_files(files: RunFiles, workers: Sequence[Registration], identity_file: Path | None) -> RunFiles:
    """Write known_hosts, ssh_config, then the hostfile (last: its presence means the run is ready).

    Each file is written to a temp path and renamed (mode 0600: they are for the user who started the run);
    nothing is written if the hostfile would be invalid.

    :param files: where to write.
    :param workers: registrations in node-rank order.
    :param identity_file: the run's private key, for ssh_config.
    :rtype: RunFiles
    """
    hostfile_text = format_hostfile((w.address, w.slots) for w in workers)
    atomic_write(files.known_hosts, format_known_hosts(workers), mode=0o600)
    atomic_write(files.ssh_config, format_ssh_config(workers, identity_file, files.known_hosts), mode=0o600)
    atomic_write(files.hostfile, hostfile_text, mode=0o600)
    logger.info(
        "wrote %s (%d workers), %s and %s", files.hostfile, len(workers), files.known_hosts.name, files.ssh_config.name
    )
    return files
