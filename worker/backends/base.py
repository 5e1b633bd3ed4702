"""The one interface every backend implements: launch / wait / stop (plus a health check)."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.constants import DEFAULT_SSH_PORT

logger = logging.getLogger(__name__)


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
    """Starts and stops worker pods that run ``python -m worker.agent``.

    Methods that must be overridden: :meth:`launch`, :meth:`stop`. Methods that may be overridden:
    :meth:`wait` (pods running), :meth:`failures` (pods that died), :meth:`rendezvous_host`,
    :meth:`advertised_address`, :meth:`ssh_port`. A backend is a context manager that stops its
    pods on exit.
    """

    name = "backend"
    #: False for backends whose hosts already exist and register no agent (``static``).
    runs_agents = True
    #: Where workers' logs and files go on the master (``RUN_DIR/workers``); start_workers sets it.
    workdir: Path | None = None

    @abstractmethod
    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        """Start ``count`` agents with ``env`` (the run's rendezvous settings) added to their environment.

        :param count: number of workers.
        :param resources: per-pod CPU, memory and GPUs.
        :param env: variables every agent gets.
        :rtype: list[WorkerHandle]
        """

    def wait(self, timeout: float) -> None:
        """Block until the launched pods are running (or raise WorkerError naming the ones that failed).

        :param timeout: seconds to wait.
        """

    def failures(self) -> dict[str, str]:
        """Pods that stopped before being stopped, with the reason (exit code, last log line).

        :rtype: dict[str, str]
        """
        return {}

    @abstractmethod
    def stop(self) -> None:
        """Stop every pod this backend launched. Idempotent; never raises for pods already gone."""

    def rendezvous_host(self) -> str:
        """The address the rendezvous server listens on.

        :rtype: str
        """
        return "0.0.0.0"

    def advertised_address(self) -> str:
        """The master's address as workers reach it.

        :rtype: str
        """
        raise NotImplementedError

    def ssh_port(self, requested: int | None, count: int) -> int:
        """The sshd port workers use.

        :param requested: the user's choice, or None.
        :param count: number of workers.
        :rtype: int
        """
        return DEFAULT_SSH_PORT if requested is None else requested

    @property
    def pods(self) -> Sequence[WorkerHandle]:
        """Workers launched so far.

        :rtype: Sequence[WorkerHandle]
        """
        return ()

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
