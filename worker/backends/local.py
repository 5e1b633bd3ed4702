"""``local``: worker "pods" as agent processes on this machine, one loopback address each.

Worker i listens on 127.0.0.(i+2) with its own sshd, so a laptop, CI and the offline demo run the
same multi-node path (rendezvous, verified ssh, pdsh, DeepSpeed's launcher) as a real cluster.
All workers share one sshd port, chosen free on every address (DeepSpeed's ``--ssh_port`` is one
number for all hosts).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from worker import constants as c
from worker.backends.base import Backend, Resources, WorkerHandle, inherited_environment
from worker.errors import WorkerError
from worker.files import last_line, private_dir, private_opener
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
    """Agents as child processes; ``sshd=False`` runs them register-only (benchmarks);
    ``replacements=False`` is a platform with no capacity left (tests of a run that goes on with fewer)."""

    name = "local"

    def __init__(self, sshd: bool = True, python: str = sys.executable, replacements: bool = True) -> None:
        """
        :param sshd: start an sshd per worker (False: register-only agents).
        :param python: interpreter that runs ``-m worker.agent``.
        :param replacements: False: :meth:`replace` starts nothing and says so.
        """
        self.sshd = sshd
        self.python = python
        self.replacements = replacements
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, Path] = {}
        # What launch() was given, so a replacement starts as the original did: pod -> address index.
        self._indexes: dict[str, int] = {}
        self._env: dict[str, str] = {}
        # Each agent's TMPDIR (its heartbeat socket's directory): a local pod's temporary space is this machine's,
        # and an agent killed hard cannot remove its own files, so the backend does when the pod ends.
        self._tmpdirs: dict[str, Path] = {}
        self._slots = 1
        self._replaced = 0

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
        self._env, self._slots = dict(env), max(1, resources.gpus)
        start = len(self._indexes)
        for index in range(start, start + count):
            self._start(f"local-{index}", index)
        logger.info("launched %d local workers (logs in %s)", count, self._workdir())
        return self.pods[start:]

    def replace(self, pod: str, timeout: float) -> WorkerHandle:
        """Stop what is left of ``pod`` and start a new agent (``local-N-rK``) on the same loopback address.

        :param pod: the lost worker's pod name.
        :param timeout: unused: the new agent is started at once; the rendezvous waits for it.
        :rtype: WorkerHandle
        """
        if pod not in self._indexes:
            raise WorkerError(f"no local worker {pod!r} to replace; launched: {', '.join(self._indexes) or 'none'}")
        old = self._processes.pop(pod, None)
        if old is not None and old.poll() is None:
            old.kill()  # lost already: no grace to give
            old.wait()
        self._remove_tmpdir(pod)
        if not self.replacements:
            raise WorkerError(f"no capacity for a replacement of {pod} (local backend with replacements=False)")
        self._replaced += 1
        index = self._indexes.pop(pod)
        replacement = f"local-{index}-r{self._replaced}"
        self._start(replacement, index)
        logger.info("replaced local worker %s with %s on %s", pod, replacement, loopback_address(index))
        return WorkerHandle(replacement, f"pid {self._processes[replacement].pid}")

    def _workdir(self) -> Path:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="textsql-local-workers-"))
        private_dir(self.workdir)
        return self.workdir

    def _start(self, pod: str, index: int) -> None:
        workdir = self._workdir()
        self._tmpdirs[pod] = Path(tempfile.mkdtemp(prefix=f"textsql-{pod}-"))
        # The runtime's variables and what the run names, never the rest of the master's environment: a local pod is
        # a stand-in for a remote one, and its agent's ssh sessions must see what a remote pod's would.
        agent_env = {c.ENV_SLOTS: str(self._slots), **inherited_environment(), **self._env}
        agent_env.update(
            {
                c.ENV_ADDRESS: loopback_address(index),
                c.ENV_POD: pod,
                c.ENV_WORKER_DIR: str(workdir / pod),
                c.ENV_SSHD: "1" if self.sshd else "0",
                "TMPDIR": str(self._tmpdirs[pod]),
            }
        )
        if self.pod_key is not None:  # launched by start_workers: this pod's key, not the run's token
            agent_env.pop(c.ENV_TOKEN_FILE, None)
            agent_env[c.ENV_TOKEN] = self.pod_key(pod)
        self._logs[pod] = workdir / f"{pod}.log"
        self._indexes[pod] = index
        with open(self._logs[pod], "ab", opener=private_opener) as log:
            self._processes[pod] = subprocess.Popen(
                [self.python, "-m", "worker.agent"],
                env=agent_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

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
        for pod in list(self._tmpdirs):
            self._remove_tmpdir(pod)
        self._processes.clear()
        self._indexes.clear()

    def _remove_tmpdir(self, pod: str) -> None:
        tmpdir = self._tmpdirs.pop(pod, None)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
