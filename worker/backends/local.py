"""``local``: worker "pods" as agent processes on this machine, one loopback address each.

Worker i listens on 127.0.0.(i+2) with its own sshd, so a laptop, CI and the offline demo run the
same multi-node path (rendezvous, verified ssh, pdsh, DeepSpeed's launcher) as a real cluster.
All workers share one sshd port, chosen free on every address (DeepSpeed's ``--ssh_port`` is one
number for all hosts).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from worker.errors import WorkerError
from worker import constants as c
from worker.backends.base import Backend, Resources, WorkerHandle
from worker.files import last_line, private_opener
from worker.network import free_port_on_all
from worker.sshd import require_tool

logger = logging.getLogger(__name__)

_FIRST_HOST = 2  # 127.0.0.1 stays the master's


def loopback_address(index: int) -> str:
    """The address of local worker ``index`` (0 -> 127.0.0.2).

    :param index: the worker's index.
    :rtype: str
    """
    host = _FIRST_HOST + index
    if host > 254:
        raise WorkerError(f"the local backend runs at most {255 - _FIRST_HOST} workers; ask for fewer")
    return f"127.0.0.{host}"


class LocalBackend(Backend):
    """Agents as child processes; ``sshd=False`` runs them register-only (benchmarks)."""

    name = "local"

    def __init__(self, sshd: bool = True, python: str = sys.executable) -> None:
        """
        :param sshd: start an sshd per worker (False: register-only agents).
        :param python: interpreter that runs ``-m worker.agent``.
        """
        self.sshd = sshd
        self.python = python
        self._processes: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Path] = {}

    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def advertised_address(self) -> str:
        return "127.0.0.1"

    def ssh_port(self, requested: int | None, count: int) -> int:
        if requested is not None:
            return requested
        return free_port_on_all([loopback_address(i) for i in range(count)])

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(pod, f"pid {process.pid}") for pod, process in self._processes.items()]

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        if self.sshd:
            require_tool(c.SSHD_PATH)  # fail here, once, rather than in every agent's log
        workdir = self.workdir or Path(tempfile.mkdtemp(prefix="textsql-local-workers-"))
        workdir.mkdir(parents=True, exist_ok=True)
        start = len(self._processes)
        for index in range(start, start + count):
            pod = f"local-{index}"
            agent_env = {c.ENV_SLOTS: str(max(1, resources.gpus)), **os.environ, **env}
            agent_env.update({
                c.ENV_ADDRESS: loopback_address(index),
                c.ENV_POD: pod,
                c.ENV_WORKER_DIR: str(workdir / pod),
                c.ENV_SSHD: "1" if self.sshd else "0",
            })
            self._logs[pod] = workdir / f"{pod}.log"
            with open(self._logs[pod], "ab", opener=private_opener) as log:
                self._processes[pod] = subprocess.Popen(
                    [self.python, "-m", "worker.agent"], env=agent_env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
        logger.info("launched %d local workers (logs in %s)", count, workdir)
        return self.pods[start:]

    def failures(self) -> dict[str, str]:
        failed = {}
        for pod, process in self._processes.items():
            if process.poll() is not None:
                failed[pod] = f"exited with code {process.returncode}: {last_line(self._logs[pod])}"
        return failed

    def stop(self) -> None:
        for process in self._processes.values():
            if process.poll() is None:
                process.terminate()
        for pod, process in self._processes.items():
            try:
                process.wait(timeout=c.STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("worker %s ignored SIGTERM; killing it", pod)
                process.kill()
                process.wait()
        if self._processes:
            logger.info("stopped %d local workers", len(self._processes))
        self._processes.clear()
