"""Start N workers, collect their authenticated registrations, write the run's files, stop them all.

Usage::

    with start_workers("local", 2, Path("runs/demo")) as cluster:
        subprocess.run(cluster.ssh_command(cluster.hosts[0], "hostname"), check=True)
        env = {**os.environ, **cluster.pdsh_env}   # for deepspeed --launcher pdsh --hostfile cluster.hostfile
    # every launched worker is released and stopped here, also after an error or KeyboardInterrupt
"""

from __future__ import annotations

import atexit
import logging
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from worker import constants as c
from worker.backends import Backend, Resources, make_backend
from worker.beats import Beat
from worker.errors import RendezvousError, WorkerError
from worker.registration import Registration
from worker.rendezvous.server import RendezvousServer
from worker.rendezvous.token import new_token, pod_key
from worker.runfiles import RunFiles, write_run_files
from worker.ssh import ssh_argv, ssh_options
from worker.sshd import generate_keypair

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cluster:
    """The registered workers of one run and the files that reach them.

    ``master_addr`` is the rank-0 worker's address (first hostfile line), the value for DeepSpeed's
    ``--master_addr``; ``rendezvous`` is where the master's registration server listened (``("", 0)``
    for a backend that attaches to existing hosts, which register nothing).
    ``ssh_port`` is the workers' common sshd port (each worker's own is in ``workers`` and ssh_config).
    """

    run_dir: Path
    hostfile: Path
    known_hosts: Path
    ssh_config: Path
    identity_file: Path | None
    ssh_port: int
    master_addr: str
    rendezvous: tuple[str, int]
    workers: tuple[Registration, ...]
    backend: Backend
    _stop: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)
    # The rendezvous that launched workers registered on (None for attached hosts); replacements register there.
    _server: RendezvousServer | None = field(default=None, repr=False, compare=False)

    def stop(self) -> None:
        """Release and stop every worker now (what leaving the ``with`` block does). Safe to call twice."""
        self._stop()

    def lost(self) -> dict[str, str]:
        """Workers known to be gone: address -> why (agent hung up on the rendezvous, or the backend saw its pod end).

        :rtype: dict[str, str]
        """
        lost = self._server.lost() if self._server is not None else {}
        by_pod = {worker.pod: worker.address for worker in self.workers}
        for pod, reason in self.backend.failures().items():
            if pod in by_pod:
                lost.setdefault(by_pod[pod], f"pod {pod} {reason}")
        return lost

    def relay_beats(self, receive: Callable[[str, Beat], None] | None) -> frozenset[str]:
        """Give ``receive`` (None: nobody) every heartbeat the workers' agents relay, signed with each pod's key.

        :param receive: called with the worker's address and one of its ranks' heartbeats.
        :rtype: frozenset[str]
        :returns: the workers heard that way: every launched one (attached hosts have no agent of ours).
        """
        if self._server is None:
            return frozenset()
        self._server.beats_to = receive
        return frozenset(self.hosts)

    def replace_worker(self, address: str, timeout: float = 300.0) -> Cluster:
        """Replace the lost worker at ``address`` through the backend and rewrite the run's files.

        A launched replacement (a new local process, CML engine or Kubernetes pod) must be running and
        registered over the same authenticated rendezvous (same token) within ``timeout``; then the
        hostfile, known_hosts (its new host key pinned) and ssh_config are written again. An attached
        host must answer again (see :meth:`Backend.replace`).

        :param address: the lost worker's address.
        :param timeout: seconds for the replacement to be running and registered (or the host to answer).
        :rtype: Cluster
        :returns: the cluster with the replacement in the lost worker's place.
        :raises WorkerError: if the backend cannot replace it, or no replacement registered in time
            (the message names the replacement, what it was waiting for and what to check).
        """
        lost = next((worker for worker in self.workers if worker.address == address), None)
        if lost is None:
            raise WorkerError(f"{address} is not a worker of this run; workers: {' '.join(self.hosts)}")
        if self._server is None:
            # The same host, its key from the trusted known_hosts: the run's files stay as they are.
            self.backend.replace(lost.pod, timeout)
            return self
        deadline = time.monotonic() + timeout
        self._server.reopen(address)
        handle = self.backend.replace(lost.pod, timeout)
        try:
            workers = _registered(self.backend, self._server, [handle.pod], deadline, timeout)
        except (WorkerError, RendezvousError) as error:
            raise WorkerError(
                f"no replacement for lost worker {address} (pod {lost.pod}) registered within {timeout:.0f}s: {error}"
            ) from None
        new = next((worker.address for worker in workers if worker.pod == handle.pod), "?")
        logger.info("worker %s (pod %s) replaced by %s (pod %s)", address, lost.pod, new, handle.pod)
        return replace(self, workers=tuple(workers), master_addr=workers[0].address)

    def without_worker(self, address: str) -> Cluster:
        """The cluster without the lost worker at ``address``, for a run that goes on with fewer workers:
        the run's hostfile, known_hosts and ssh_config are written again for the others, and the rendezvous
        counts the run as full with them (a replacement that registers late is refused).

        :param address: the lost worker's address.
        :rtype: Cluster
        :raises WorkerError: if ``address`` is not a worker of this run, or the last one.
        """
        remaining = tuple(worker for worker in self.workers if worker.address != address)
        if len(remaining) == len(self.workers):
            raise WorkerError(f"{address} is not a worker of this run; workers: {' '.join(self.hosts)}")
        if not remaining:
            raise WorkerError(f"{address} is the run's last worker; there is nothing to go on with")
        if self._server is not None:
            self._server.drop(address)
        write_run_files(RunFiles(self.hostfile, self.known_hosts, self.ssh_config), remaining, self.identity_file)
        logger.info("going on without worker %s: %d left", address, len(remaining))
        return replace(self, workers=remaining, master_addr=remaining[0].address)

    @property
    def hosts(self) -> list[str]:
        """Worker addresses in node-rank order (the hostfile's order).

        :rtype: list[str]
        """
        return [worker.address for worker in self.workers]

    @property
    def slots(self) -> int:
        """Total slots (ranks) across workers.

        :rtype: int
        """
        return sum(worker.slots for worker in self.workers)

    @property
    def pdsh_env(self) -> dict[str, str]:
        """Environment that makes pdsh (and so ``deepspeed --launcher pdsh``) use this run's ssh_config.

        :rtype: dict[str, str]
        """
        return {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": shlex.join(ssh_options(self.ssh_config))}

    def ssh_command(self, host: str, command: str) -> list[str]:
        """``ssh -F ssh_config -o BatchMode=yes -- HOST COMMAND`` as an argument list (host keys verified).

        :param host: a worker address.
        :param command: the remote shell command.
        :rtype: list[str]
        """
        return ssh_argv(ssh_options(self.ssh_config), host, command)

    def answers(self, host: str, timeout: float = 15.0, attempts: int = c.SSH_PROBE_ATTEMPTS) -> bool:
        """Whether ``host`` runs ``true`` over the run's ssh, trying ``attempts`` times with a growing pause
        between them: one failed connection (a moment of load, a flood that sshd is shedding) is not a lost worker.

        :param host: a worker address.
        :param timeout: seconds for each attempt.
        :param attempts: how many tries before it counts as not answering.
        :rtype: bool
        """
        pause = c.SSH_PROBE_BACKOFF_S
        for attempt in range(attempts):
            try:
                result = self.ssh(host, "true", timeout=timeout)
                if result.returncode == 0:
                    return True
                reason = f"exit {result.returncode}: {result.stderr.strip()[-200:]}"
            except subprocess.TimeoutExpired:
                reason = f"no answer within {timeout:g}s"
            logger.warning("ssh to %s failed (attempt %d of %d): %s", host, attempt + 1, attempts, reason)
            if attempt + 1 < attempts:
                time.sleep(pause)
                pause *= 2
        return False

    def ssh(self, host: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on ``host`` over the run's ssh configuration.

        :param host: a worker address.
        :param command: the remote shell command.
        :param timeout: seconds before giving up.
        :rtype: subprocess.CompletedProcess
        """
        command_line = self.ssh_command(host, command)
        return subprocess.run(
            command_line, check=False, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )


def _run_secrets(directory: Path, run_name: str) -> tuple[Path, str, str]:
    """The per-run token and ssh client key (pods get only their own key and the public half):
    (identity file, token, public key)."""
    token = new_token(directory / c.TOKEN_NAME)
    identity = directory / c.IDENTITY_NAME
    public_key = generate_keypair(identity, f"textsql-run@{run_name}")
    return identity, token, public_key


def _master_dir(run_dir: Path, backend: Backend, stack: ExitStack) -> Path:
    """Where the run's token, client key, hostfile, known_hosts and ssh_config go: the run dir, unless the
    workers share it (a project volume), where a worker could read the key or add a ProxyCommand to
    ssh_config; then a private directory on the master's own disk, removed when the workers are stopped."""
    if not backend.shares_run_dir:
        return run_dir
    directory = Path(tempfile.mkdtemp(prefix=f"textsql-{run_dir.name}-"))  # 0700
    stack.callback(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _backend(backend: str | Backend, options: dict[str, Any]) -> Backend:
    """The backend named, built with ``options``; or the one given, built already (so it takes none)."""
    if isinstance(backend, str):
        return make_backend(backend, **options)
    if options:
        raise WorkerError(f"options {sorted(options)} go to the backend's constructor, not with a Backend instance")
    return backend


def _registered(
    backend: Backend, server: RendezvousServer, pods: list[str], deadline: float, timeout: float
) -> list[Registration]:
    """Every worker once ``pods`` run and their agents registered, by ``deadline`` (``timeout``: the whole wait)."""
    backend.wait(max(0.0, deadline - time.monotonic()))
    left = max(0.0, deadline - time.monotonic())
    return server.wait(left, expected_pods=pods, check=lambda: _check_pods(backend), total=timeout)


def _check_pods(backend: Backend) -> None:
    failed = backend.failures()
    if failed:
        pod, reason = next(iter(sorted(failed.items())))
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise RendezvousError(f"worker {pod} {reason}{more}; nothing was written")


@contextmanager
def start_workers(
    backend: str | Backend,
    count: int,
    run_dir: Path | str,
    *,
    timeout: float = 300.0,
    resources: Resources | None = None,
    ssh_port: int | None = None,
    env: Mapping[str, str] | None = None,
    rendezvous_port: int = 0,
    master_address: str | None = None,
    **backend_options: Any,
) -> Iterator[Cluster]:
    """Launch (or attach to) ``count`` workers, wait for all of them, and yield the :class:`Cluster`.

    A launching backend (``attaches`` False) gets, in ``run_dir`` (0700), the per-run token
    (``rendezvous.token``, 0600) and ssh client key (``id_ed25519``/``.pub``), from which each agent gets
    its own key and the public half, and ``hostfile``, ``known_hosts`` and ``ssh_config`` (0600) once every
    worker registered; worker logs go under ``run_dir/workers``. Where the workers share ``run_dir``
    (``Backend.shares_run_dir``: cml, kubernetes, slurm, static) those files go to a private directory on this
    machine instead (:attr:`Cluster.hostfile` names it), removed when the workers are stopped. An attaching backend
    (``static``) writes the hostfile, known_hosts and ssh_config from :meth:`Backend.attach`. On leaving the block (normally, on error, on timeout or on
    KeyboardInterrupt) workers are released and the backend stops them.

    :param backend: ``local``, ``cml``, ``kubernetes``, ``static``, or a :class:`Backend` instance.
    :param count: number of workers.
    :param run_dir: the run directory (created; must be visible to pods on a shared volume for cml/kubernetes).
    :param timeout: seconds for all workers to be running and registered.
    :param resources: CPU, memory and GPUs per worker pod.
    :param ssh_port: sshd port on the workers (local: a free one; static: 22; others: 2222).
    :param env: extra environment for every agent.
    :param rendezvous_port: port of the master's rendezvous server (0: any free port).
    :param master_address: the master's address as workers reach it (default: the backend's guess).
    :param backend_options: the backend's options (:meth:`Backend.from_options`; notebook 02's ``backend_options``).
    :rtype: Iterator[Cluster]
    :raises RendezvousError: one line naming how many workers came and which are missing.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise RendezvousError(f"worker count {count!r} must be a positive integer")
    run_dir = Path(run_dir).resolve()
    backend = _backend(backend, backend_options)
    backend.workdir = run_dir / c.WORKERS_DIR_NAME
    deadline = time.monotonic() + timeout
    with ExitStack() as stack:
        stack.callback(backend.stop)
        files = RunFiles.cleared(run_dir)
        if backend.shares_run_dir:
            files = RunFiles.cleared(_master_dir(run_dir, backend, stack))
        port = backend.ssh_port(ssh_port, count)
        if backend.attaches:
            identity, rendezvous, server = backend.identity_file, ("", 0), None
            workers = backend.attach(count, port)
            write_run_files(files, workers, identity)
        else:
            identity, token, public_key = _run_secrets(files.hostfile.parent, run_dir.name)
            server = stack.enter_context(
                RendezvousServer(
                    expect=count,
                    token=token,
                    host=backend.rendezvous_host(),
                    port=rendezvous_port,
                    files=files,
                    identity_file=identity,
                    check_peer=True,
                )
            )
            rendezvous = (master_address or backend.advertised_address(), server.endpoint[1])
            agent_env = {
                **(env or {}),
                c.ENV_RENDEZVOUS: f"{rendezvous[0]}:{rendezvous[1]}",
                c.ENV_CLIENT_PUBKEY: public_key,
                c.ENV_SSH_PORT: str(port),
                c.ENV_DEADLINE: str(int(timeout)),
            }
            backend.pod_key = partial(pod_key, token)
            handles = backend.launch(count, resources or Resources(), agent_env)
            workers = _registered(backend, server, [h.pod for h in handles], deadline, timeout)
        logger.info("%d workers ready: %s", len(workers), " ".join(w.address for w in workers))
        yield _cluster(run_dir, files, identity, port, rendezvous, workers, backend, stack.close, server)


def _cluster(
    run_dir: Path,
    files: RunFiles,
    identity: Path | None,
    port: int,
    rendezvous: tuple[str, int],
    workers: list[Registration],
    backend: Backend,
    stop: Callable[[], None],
    server: RendezvousServer | None,
) -> Cluster:
    ports = {worker.ssh_port for worker in workers if worker.ssh_port is not None}
    return Cluster(
        run_dir=run_dir,
        hostfile=files.hostfile,
        known_hosts=files.known_hosts,
        ssh_config=files.ssh_config,
        identity_file=identity,
        ssh_port=ports.pop() if len(ports) == 1 else port,
        master_addr=workers[0].address,
        rendezvous=rendezvous,
        workers=tuple(workers),
        backend=backend,
        _stop=stop,
        _server=server,
    )


def open_workers(backend: str | Backend, count: int, run_dir: Path | str, **options: Any) -> Cluster:
    """:func:`start_workers` for notebooks, where one ``with`` block cannot span cells.

    Usage::

        cluster = open_workers("local", 2, "runs/demo")   # one cell
        ...                                              # training cells
        cluster.stop()                                   # last cell; also runs when the kernel exits

    :param backend: as for :func:`start_workers`.
    :param count: number of workers.
    :param run_dir: the run directory.
    :param options: the other arguments of :func:`start_workers`.
    :rtype: Cluster
    """
    context = start_workers(backend, count, run_dir, **options)

    # The cluster keeps the context (and so the suspended generator) alive until stopped.
    def stop() -> None:
        context.__exit__(None, None, None)

    cluster = replace(context.__enter__(), _stop=stop)
    atexit.register(cluster.stop)
    return cluster
