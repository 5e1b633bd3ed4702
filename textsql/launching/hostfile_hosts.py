"""The hosts of an existing hostfile as the supervisor replaces and drops a run's workers.

A :class:`worker.cluster.Cluster` replaces a lost worker through its backend and drops one by writing the
run's files again. The hosts of a hostfile the user brought (``textsql launch --hostfile``, plain ssh) have
no backend, yet offer the supervisor the same (:class:`textsql.launching.recovery.ReplaceableHosts`): a lost
host is *replaced* by waiting for it to answer ssh again (a VM rebooting, sshd restarted; the supervisor's
line says ``host HOST answers ssh again``), and dropped by writing the hosts left to
``RUN_DIR/hostfile.remaining``, atomically, which the next launch uses. The user's own hostfile is never
written: it still lists every host for the next run, and the supervisor's ``shrunk`` line names the file the
run went on with.

Usage::

    >>> hosts = HostfileHosts.read(LaunchArguments(run_dir=Path("runs/r1"), hostfile=Path("hosts")))
    >>> hosts = hosts.replace_worker("10.0.0.6", timeout=120)  # WorkerError: not back in time
    >>> hosts = hosts.without_worker("10.0.0.6")               # runs/r1/hostfile.remaining
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from textsql.launching.command import LaunchArguments
from textsql.launching.preflight import launch_ssh_options
from worker.beats import Beat
from worker.constants import HOSTFILE_NAME
from worker.errors import WorkerError
from worker.hostfile import read_hostfile, write_hostfile
from worker.ssh import ssh_argv

logger = logging.getLogger(__name__)

# What a hostfile run goes on with after a host is dropped (the user's hostfile stays as it was).
REMAINING_HOSTFILE_NAME = "hostfile.remaining"
# Seconds between ssh checks of a host that is waited for.
RETRY_PAUSE_S = 5.0


@dataclass(frozen=True)
class HostfileHosts:
    """The hosts of a hostfile, reached with the launch's own ssh options (see the module docstring).

    ``clock`` and ``sleep`` are what waiting for a host reads and does (a test passes a fake clock).
    """

    run_dir: Path
    hostfile: Path
    slots: dict[str, int]
    ssh_config: Path | None = None
    ssh_port: int | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)

    @classmethod
    def read(cls, arguments: LaunchArguments) -> HostfileHosts:
        """The hosts of the launch's hostfile (``--hostfile``, else ``RUN_DIR/hostfile``).

        :rtype: HostfileHosts
        :raises HostfileError: if the hostfile is missing or malformed.
        """
        hostfile = (arguments.hostfile or arguments.run_dir / HOSTFILE_NAME).resolve()
        return cls(arguments.run_dir, hostfile, read_hostfile(hostfile), arguments.ssh_config, arguments.ssh_port)

    @property
    def hosts(self) -> list[str]:
        """The hosts in node-rank order (the hostfile's).

        :rtype: list[str]
        """
        return list(self.slots)

    def lost(self) -> dict[str, str]:
        """Nothing watches a hostfile's hosts: a loss shows only in the launch (ssh failing, a rank killed).

        :rtype: dict[str, str]
        """
        return {}

    def relay_beats(self, receive: Callable[[str, Beat], None] | None) -> frozenset[str]:
        """No agent of ours runs on a hostfile's hosts: their heartbeats come on the launch's stream alone.

        :param receive: whom the agents' heartbeats would go to.
        :rtype: frozenset[str]
        :returns: no host.
        """
        return frozenset()

    def answers(self, host: str, timeout: float = 15.0) -> bool:
        """Whether ``host`` runs ``true`` over the launch's ssh within ``timeout`` seconds.

        :rtype: bool
        """
        try:
            result = subprocess.run(
                self.ssh_command(host, "true"),
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            logger.info("ssh to %s: no answer within %gs", host, timeout)
            return False
        if result.returncode:
            logger.info("ssh to %s: exit %d: %s", host, result.returncode, result.stderr.strip()[-200:])
        return result.returncode == 0

    def replace_worker(self, host: str, timeout: float) -> HostfileHosts:
        """Wait up to ``timeout`` seconds for the lost ``host`` to answer ssh again: the same host, the same hosts.

        :rtype: HostfileHosts
        :raises WorkerError: when it did not answer in time (the message says what to check).
        """
        self._check_host(host)
        deadline = self.clock() + timeout
        while True:
            left = deadline - self.clock()
            if self.answers(host, timeout=max(1.0, min(15.0, left))):
                return self
            left = deadline - self.clock()
            if left <= 0:
                break
            self.sleep(min(RETRY_PAUSE_S, left))
        raise WorkerError(
            f"lost host {host} of {self.hostfile} did not answer ssh again within {timeout:g}s; "
            "check the host and its sshd"
        )

    def without_worker(self, host: str) -> HostfileHosts:
        """The hosts without ``host``, written to ``RUN_DIR/hostfile.remaining`` (atomically) for the next launch.

        :rtype: HostfileHosts
        :raises WorkerError: if ``host`` is not one of the hosts, or the last one.
        """
        self._check_host(host)
        remaining = {name: slots for name, slots in self.slots.items() if name != host}
        if not remaining:
            raise WorkerError(f"{host} is the run's last host; there is nothing to go on with")
        hostfile = write_hostfile(self.run_dir / REMAINING_HOSTFILE_NAME, remaining.items()).resolve()
        logger.info("going on without host %s: %d left, in %s", host, len(remaining), hostfile)
        return replace(self, hostfile=hostfile, slots=remaining)

    def ssh_command(self, host: str, command: str) -> list[str]:
        """``ssh OPTIONS -- HOST COMMAND`` with the options pdsh runs the launch with.

        :rtype: list[str]
        """
        return ssh_argv(launch_ssh_options(self.run_dir, self.ssh_config, self.ssh_port), host, command)

    def _check_host(self, host: str) -> None:
        if host not in self.slots:
            raise WorkerError(f"{host} is not a host of {self.hostfile}; hosts: {' '.join(self.hosts)}")
