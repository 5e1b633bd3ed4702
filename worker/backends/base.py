"""The one interface every backend implements, and the only one :func:`worker.cluster.start_workers` uses.

A backend declares how its workers come to be (:attr:`Backend.attaches`), and with it how their ssh
host keys are trusted; everything start_workers calls is declared here.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from worker.constants import DEFAULT_SSH_PORT, INHERITED_ENV
from worker.errors import WorkerError
from worker.registration import Registration

logger = logging.getLogger(__name__)


def inherited_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What an agent this machine starts inherits of its environment: the runtime's variables
    (:data:`worker.constants.INHERITED_ENV`), by name, and nothing else: no credential of the master's reaches a worker.

    :param environ: the master's environment.
    :rtype: dict[str, str]
    """
    return {name: environ[name] for name in INHERITED_ENV if name in environ}


@dataclass(frozen=True)
class Resources:
    """What each worker pod asks for."""

    cpu: float = 2.0
    memory_gb: float = 8.0
    gpus: int = 0


@dataclass(frozen=True)
class WorkerHandle:
    """One launched worker: ``pod`` is the name its agent reports back (``TEXTSQL_WORKER_POD``)."""

    pod: str
    detail: str = ""


class Backend(ABC):
    """Provides the workers of a run: launches pods that run ``python -m worker.agent``, or attaches to hosts.

    Class variables that may be overridden:

    - :attr:`attaches` ``False`` (``local``, ``cml``, ``kubernetes``): the backend *launches* agents. Each
      starts its own sshd with a fresh host key and reports that key over the authenticated rendezvous;
      the run's known_hosts holds exactly those keys and the run's own client key logs in.
      Must override :meth:`launch` and :meth:`advertised_address`; may override :meth:`wait`,
      :meth:`failures`, :meth:`rendezvous_host`.
    - :attr:`attaches` ``True`` (``static``): the backend *attaches* to hosts that already run sshd.
      Nothing is launched and no agent registers: :meth:`attach` checks every host over ssh and
      describes it; host keys are copied from :attr:`known_hosts`, a file the user trusts, and
      :attr:`identity_file` logs in.

    Every backend must override :meth:`stop`, and may override :meth:`ssh_port` and :attr:`pods`. A
    subclass that lacks a method its declaration needs is refused when it is defined (``TypeError``).
    A backend is a context manager that stops its pods on exit.
    """

    name: ClassVar[str] = "backend"
    #: False: launches agents that register over the rendezvous; True: attaches to hosts running sshd.
    attaches: ClassVar[bool] = False
    #: Attaching backends: the trusted known_hosts their hosts' keys come from (launching ones: None,
    #: the keys arrive with the authenticated registrations).
    known_hosts: Path | None = None
    #: Attaching backends: the private key the hosts accept (None: ssh's defaults). Launching ones
    #: leave it None: start_workers makes a key per run and hands its public half to the agents.
    identity_file: Path | None = None
    #: True where the workers may mount the run directory (a shared project volume, a cluster filesystem, NFS
    #: between static hosts), so start_workers keeps the run's token, client key and ssh files out of it, in a
    #: private directory on the master alone: ssh runs what an ssh_config says (``ProxyCommand``, ``Match exec``).
    shares_run_dir: ClassVar[bool] = False
    #: Where workers' logs and files go on the master (``RUN_DIR/workers``); start_workers sets it.
    workdir: Path | None = None
    #: Launching backends: the key of the pod with this name, which only that pod may receive (its own
    #: environment or Secret), never the run token; start_workers sets it.
    pod_key: Callable[[str], str] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        needed = ("attach",) if cls.attaches else ("launch", "advertised_address")
        missing = [method for method in needed if getattr(cls, method) is getattr(Backend, method)]
        if missing:
            raise TypeError(
                f"{cls.__name__} declares attaches = {cls.attaches} but does not override {', '.join(missing)}"
            )

    @classmethod
    def from_options(cls, **options: Any) -> Self:
        """The backend built from notebook 02's ``backend_options`` (:func:`~worker.backends.make_backend`): by
        default, its constructor's keyword arguments.

        :rtype: Backend
        """
        return cls(**options)

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        """Start ``count`` agents with ``env`` (the run's rendezvous settings) added to their environment,
        and each agent's own :attr:`pod_key` of the name it registers under (``TEXTSQL_WORKER_POD``).

        :param count: number of workers.
        :param resources: per-pod CPU, memory and GPUs.
        :param env: variables every agent gets.
        :rtype: list[WorkerHandle]
        """
        raise WorkerError(f"the {self.name!r} backend attaches to hosts that already run sshd; it launches nothing")

    def attach(self, count: int, ssh_port: int) -> list[Registration]:
        """Check ``count`` existing hosts over ssh and describe each as a registration (host key from :attr:`known_hosts`).

        :param count: number of workers asked for.
        :param ssh_port: sshd port on every host.
        :rtype: list[Registration]
        """
        raise WorkerError(f"the {self.name!r} backend launches its workers; it has no existing hosts to attach to")

    def wait(self, timeout: float) -> None:
        """Block until the launched pods are running (or raise WorkerError naming the ones that failed).

        :param timeout: seconds to wait.
        """

    def failures(self) -> dict[str, str]:
        """Pods that stopped before being stopped, with the reason (exit code, last log line).

        :rtype: dict[str, str]
        """
        return {}

    def replace(self, pod: str, timeout: float) -> WorkerHandle:
        """Provide a worker in place of ``pod``, which was lost during the run.

        A launching backend stops what is left of ``pod`` and launches one new agent with the run's
        environment; it registers over the same rendezvous (same token, its own new host key) at the
        same address where the platform allows, else at a new one, under a name that shows what it
        replaces where the platform lets us name it. An attaching backend waits up to
        ``timeout`` seconds for the same host to answer over ssh again: it has no other host to offer.

        :param pod: the lost worker's pod name.
        :param timeout: seconds the replacement may take.
        :rtype: WorkerHandle
        :raises WorkerError: if this backend cannot replace workers, or none came within ``timeout``.
        """
        raise WorkerError(f"the {self.name!r} backend cannot replace a lost worker ({pod}); start the run again")

    @abstractmethod
    def stop(self) -> None:
        """Stop every pod this backend launched. Idempotent; never raises for pods already gone."""

    def rendezvous_host(self) -> str:
        """The address the rendezvous server listens on: the interface the workers reach
        (:meth:`advertised_address`), so it is not open on every interface; "0.0.0.0" where that is unknown.

        :rtype: str
        """
        try:
            return self.advertised_address()
        except WorkerError:
            return "0.0.0.0"

    def advertised_address(self) -> str:
        """The master's address as launched workers reach it.

        :rtype: str
        """
        raise WorkerError(f"the {self.name!r} backend launches no agents, so they need no master address")

    def ssh_port(self, requested: int | None, count: int) -> int:
        """The sshd port workers use.

        :param requested: the user's choice, or None.
        :param count: number of workers.
        :rtype: int
        """
        return DEFAULT_SSH_PORT if requested is None else requested

    @property
    def pods(self) -> Sequence[WorkerHandle]:
        """Workers launched (or attached) so far.

        :rtype: Sequence[WorkerHandle]
        """
        return ()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
