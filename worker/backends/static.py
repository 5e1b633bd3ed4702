"""``static``: hosts that already run sshd (a list of nodes, or an existing hostfile).

Nothing is launched and no agent registers: each host is checked over ssh with the user's key and
known_hosts (``BatchMode``, ``StrictHostKeyChecking yes``), its slots read from ``HOST slots=N``
or counted with ``nvidia-smi -L``, and its host key copied from the trusted known_hosts into the
run's known_hosts, so the run's ssh_config verifies hosts exactly as the user's own ssh does. The run's hostfile,
known_hosts and ssh_config go to a private directory on the master (:attr:`shares_run_dir`), never the run directory:
a host that can write it (a shared filesystem) could otherwise add a ``ProxyCommand`` or ``Match exec`` that ssh
runs on the master.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from worker.backends.base import Backend, WorkerHandle
from worker.errors import WorkerError
from worker.hostfile import parse_hostfile, read_hostfile
from worker.registration import Registration, check_host_key, check_pod
from worker.runfiles import known_hosts_pattern
from worker.ssh import ssh_argv, ssh_options
from worker.sshd import require_tool

logger = logging.getLogger(__name__)

# Seconds between checks of a lost host.
_RETRY_S = 5.0
_PROBE = "hostname; nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true"


class StaticBackend(Backend):
    """Existing SSH hosts, attached (:meth:`attach`) rather than launched."""

    name = "static"
    attaches = True
    # The hosts may mount the run directory (the checkpoint store guide shares it over NFS): the run's hostfile,
    # known_hosts and ssh_config, which ssh runs with on the master, stay off it.
    shares_run_dir = True

    def __init__(
        self,
        hosts: Sequence[str] | str | Path,
        identity_file: str | Path | None = None,
        known_hosts: str | Path = "~/.ssh/known_hosts",
        user: str | None = None,
        connect_timeout: int = 10,
    ) -> None:
        """
        :param hosts: ``["node1", "node2 slots=4"]``, or the path of a hostfile.
        :param identity_file: private key to log in with (None: ssh's defaults).
        :param known_hosts: the trusted known_hosts holding every host's key.
        :param user: login name (None: ssh's default).
        :param connect_timeout: seconds per ssh connection.
        """
        if isinstance(hosts, (str, Path)):
            self.hosts: dict[str, int | None] = dict(read_hostfile(Path(hosts)))
        else:
            self.hosts = {}
            for entry in hosts:
                if "slots=" in entry:
                    self.hosts.update(parse_hostfile(entry, source="hosts"))
                else:
                    self.hosts[entry.strip()] = None
        self.identity_file = Path(identity_file).expanduser().resolve() if identity_file else None
        self.known_hosts = Path(known_hosts).expanduser()
        self.user = user
        self.connect_timeout = connect_timeout
        self._attached: list[Registration] = []

    def ssh_port(self, requested: int | None, count: int) -> int:
        return 22 if requested is None else requested

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(worker.pod, f"existing host {worker.address}") for worker in self._attached]

    def stop(self) -> None:
        """Nothing to stop: the hosts were there before the run and stay after it."""
        self._attached = []

    def _host_key(self, host: str, port: int) -> str:
        found = subprocess.run(
            [require_tool("ssh-keygen"), "-F", known_hosts_pattern(host, port), "-f", str(self.known_hosts)],
            check=False,
            capture_output=True,
            text=True,
        )
        for line in found.stdout.splitlines():
            fields = line.split()
            if line.startswith("#") or len(fields) < 3 or fields[0].startswith("@"):
                continue
            return check_host_key(f"{fields[1]} {fields[2]}")
        raise WorkerError(
            f"no host key for {known_hosts_pattern(host, port)} in {self.known_hosts}; after checking its fingerprint, "
            f"add it with: ssh-keyscan -p {port} {host} >> {self.known_hosts}"
        )

    def _probe(self, host: str, port: int, slots: int | None) -> Registration:
        host_key = self._host_key(host, port)
        options = ssh_options(
            port=port,
            user=self.user,
            identity_file=self.identity_file,
            known_hosts=self.known_hosts,
            connect_timeout=self.connect_timeout,
        )
        # ssh_argv ends ssh's options with --: a host named like an option (-oProxyCommand=...) is only a host.
        command = [require_tool("ssh"), *ssh_argv(options, host, _PROBE)[1:]]
        result = subprocess.run(
            command,
            check=False,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=self.connect_timeout * 3,
        )
        if result.returncode != 0:
            reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise WorkerError(f"cannot ssh to {host}:{port}: {reason}; check the key, user and known_hosts")
        hostname, gpus = (result.stdout.split() + ["", "0"])[:2]
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
        return Registration.from_dict(
            {
                "address": address,
                "slots": slots or max(1, int(gpus) if gpus.isdigit() else 1),
                "hostname": hostname,
                "pod": check_pod(host),
                "ssh_port": port,
                "host_key": host_key,
                "user": self.user,
            }
        )

    def replace(self, pod: str, timeout: float) -> WorkerHandle:
        """Wait up to ``timeout`` seconds for the same host to answer over ssh again (a static list has
        no other host to offer, and ZeRO checkpoints load only at the same world size).

        :param pod: the lost host (its name as given).
        :param timeout: seconds to wait.
        :rtype: WorkerHandle
        :raises WorkerError: if the host did not answer in time (the last ssh error says why).
        """
        index = next((i for i, worker in enumerate(self._attached) if worker.pod == pod), None)
        if index is None:
            raise WorkerError(
                f"no attached host {pod!r} to wait for; attached: {', '.join(w.pod for w in self._attached) or 'none'}"
            )
        old = self._attached[index]
        assert old.ssh_port is not None  # an attached host is one _probe reached over ssh
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._attached[index] = self._probe(pod, old.ssh_port, self.hosts.get(pod))
                return WorkerHandle(pod, f"existing host {self._attached[index].address}")
            except (WorkerError, OSError, subprocess.TimeoutExpired) as error:
                if time.monotonic() >= deadline:
                    raise WorkerError(f"host {pod} did not answer again within {timeout:.0f}s: {error}") from None
                logger.info("host %s does not answer yet: %s", pod, error)
                time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))

    def attach(self, count: int, ssh_port: int) -> list[Registration]:
        """Check every host over ssh, in parallel, and describe it as a registration.

        :param count: the number of workers asked for (must equal the number of hosts).
        :param ssh_port: sshd port on every host.
        :rtype: list[Registration]
        """
        if count != len(self.hosts):
            raise WorkerError(
                f"asked for {count} workers but the static host list has {len(self.hosts)}; pass count={len(self.hosts)}"
            )
        with ThreadPoolExecutor(max_workers=min(16, len(self.hosts))) as pool:
            self._attached = list(pool.map(lambda item: self._probe(item[0], ssh_port, item[1]), self.hosts.items()))
        return self._attached
