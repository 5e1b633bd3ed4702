"""``slurm``: worker agents as Slurm batch jobs, one job per worker, through ``sbatch``, ``squeue`` and ``scancel``.

One job per worker rather than one job of N nodes, for recovery: Slurm ends a whole job when one of its nodes
fails, and a running job cannot be given a node in place of a lost one. With a job each, a node that goes down
ends only its own worker's job; the replacement is one more job of one node, which waits in the queue (and says
why) like any other; and each job's environment carries only that worker's own rendezvous key. ``--exclusive``
(the default) keeps two workers of a run off the same node.

A job's environment is an allow-list, named in sbatch's ``--export``: the runtime's variables
(:data:`worker.constants.INHERITED_ENV`), ``SLURM_CONF``, the run's settings and the pod's own name and key. sbatch's
default (``ALL``) would give every job the master's whole environment: store, tracking and hub credentials included.

Each job runs :mod:`worker.backends.slurm_node` (then the agent) in the master's working directory, its output in
``RUN_DIR/workers/POD.log``; ``--no-requeue``, so a job whose node failed ends (``NODE_FAIL``) and is replaced by
the run's recovery rather than started again by Slurm behind its back. Jobs are named ``textsql-RUN-N`` (a
replacement ``textsql-RUN-N-rK``); :func:`cleanup` (``textsql workers cleanup --backend slurm``) cancels them
by that name when the kernel that submitted them died. Agents whose master is gone exit by themselves, and
their jobs end with them.
"""

from __future__ import annotations

import getpass
import logging
import math
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Self

from worker import constants as c
from worker.backends.base import Backend, Resources, WorkerHandle, inherited_environment
from worker.backends.slurm_options import SlurmOptions
from worker.errors import WorkerError
from worker.files import last_line, private_dir
from worker.network import route_address
from worker.rendezvous.token import pod_key, read_token

logger = logging.getLogger(__name__)

JOB_PREFIX = "textsql-"
# States in which a job holds (or waits for) its node; any other one has ended.
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING"})
# Seconds a job may wait before its reason is reported: the scheduler's first pass takes about one.
REPORT_AFTER_S = 2.0
_INSTALL_HINT = "run on a Slurm login node (or a session inside an allocation) where sbatch, squeue and scancel are"
# The one SLURM_ variable that names the cluster rather than the session's own job (a JupyterLab started by Open
# OnDemand runs inside one, whose SLURM_* settings sbatch would read as requests): a cluster configured in a file of
# its own is found by it, here and by the Slurm commands the job runs.
_CLUSTER_CONF = "SLURM_CONF"
# What sbatch's --export can name: a list of names it splits at commas, values taken from its own environment.
_EXPORTABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What Slurm's commands say on a machine that is not set up as one of its clients (no slurm.conf, no configless DNS).
_NOT_CONFIGURED = ("Could not establish a configuration source", "Unable to process configuration file")


def slurm(*command: str, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
    """Run a Slurm command and return its output; a failure raises its last error line.

    :param command: the command line (``squeue``, ``-h``, ...).
    :param env: its environment (None: this process's).
    :param stdin: text for its standard input (a batch script).
    :rtype: str
    """
    conf = (env if env is not None else os.environ).get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        # Slurm's commands would retry reading it for 60 s before saying so.
        raise WorkerError(
            f"SLURM_CONF names {conf}, which does not exist; set it to the cluster's slurm.conf, or unset it"
        )
    tool = shutil.which(command[0])
    if tool is None:
        raise WorkerError(f"{command[0]} is not on PATH; {_INSTALL_HINT}")
    try:
        result = subprocess.run(
            [tool, *command[1:]], input=stdin, capture_output=True, text=True, timeout=60, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise WorkerError(f"{command[0]} did not answer within 60 s; is slurmctld up? (scontrol ping)") from None
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        if any(words in reason for words in _NOT_CONFIGURED):
            raise WorkerError(
                f"no Slurm is configured on this machine ({reason}); set SLURM_CONF to the cluster's slurm.conf, "
                f"or {_INSTALL_HINT}"
            )
        raise WorkerError(f"{' '.join(command[:2])} failed: {reason}")
    return result.stdout


def queue() -> dict[str, tuple[str, str, str, str]]:
    """This user's jobs Slurm still lists, ended ones included: job id -> (name, state, reason, nodes).

    :rtype: dict[str, tuple[str, str, str, str]]
    """
    listed = slurm("squeue", "--noheader", "--me", "--states=all", "--format=%i|%j|%T|%r|%N")
    jobs = {}
    for line in listed.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 5:
            jobs[fields[0]] = (fields[1], fields[2], fields[3], fields[4])
    return jobs


def _partitions() -> tuple[dict[str, tuple[int, str]], str | None]:
    """Every partition's node count and its nodes' gres (``sinfo``), and the default partition's name."""
    partitions: dict[str, tuple[int, str]] = {}
    default = None
    for line in slurm("sinfo", "--noheader", "--format=%R|%P|%D|%G").splitlines():
        name, shown, nodes, gres = line.strip().split("|")
        known, gres_seen = partitions.get(name, (0, ""))
        partitions[name] = (known + int(nodes), f"{gres_seen},{gres}")
        default = name if shown.endswith("*") else default
    return partitions, default


class SlurmBackend(Backend):
    """Worker jobs submitted from a login node or a session inside an allocation."""

    name = "slurm"
    # Compute nodes mount the project (a shared filesystem): the run's token, client key and ssh files stay off it.
    shares_run_dir = True

    def __init__(self, options: SlurmOptions, python: str = sys.executable) -> None:
        """
        :param options: where and how the worker jobs run.
        :param python: the interpreter the jobs run (the same environment on a shared filesystem).
        """
        self.options = options
        self.python = python
        self.run_id = ""
        self._jobs: dict[str, str] = {}  # pod -> job id, in launch order
        self._cancelled: set[str] = set()  # job ids of workers stopped or replaced, until they leave their nodes
        self._gpus = 0
        self._resources = Resources()
        self._env: dict[str, str] = {}
        self._replaced = 0
        self._reasons: dict[str, str] = {}  # pod -> the pending reason last reported

    @classmethod
    def from_options(cls, python: str = sys.executable, **options: Any) -> Self:
        """The backend for notebook 02's ``backend_options``: :class:`SlurmOptions` fields by name.

        :rtype: SlurmBackend
        """
        return cls(SlurmOptions(**options), python)

    def advertised_address(self) -> str:
        """The interface of this machine that routes to the Slurm controller: the cluster's network.

        :rtype: str
        """
        config = slurm("scontrol", "show", "config")
        host = re.search(r"^SlurmctldHost\[0\]\s*=\s*(\S+)", config, re.MULTILINE)
        if host is None:
            raise WorkerError("scontrol show config names no SlurmctldHost; pass master_address=")
        name = re.fullmatch(r"[^(]*\(([^)]+)\)", host.group(1))  # "name(address)" or "name"
        return route_address(name.group(1) if name else host.group(1))

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(pod, f"job {job}") for pod, job in self._jobs.items()]

    def check(self, count: int, gpus: int) -> None:
        """Refuse what Slurm would leave pending forever or reject, before submitting anything: an unknown
        partition or account, more workers than the partition has nodes, GPUs its nodes lack.

        :param count: workers of the run.
        :param gpus: GPUs per worker.
        """
        if shutil.which("sbatch") is None:
            raise WorkerError(f"sbatch is not on PATH; {_INSTALL_HINT}")
        partitions, default = _partitions()
        partition = self.options.partition or default
        if partition not in partitions:
            raise WorkerError(
                f"no Slurm partition {partition!r}; set partition to one of {', '.join(sorted(partitions))} (sinfo)"
            )
        nodes, gres = partitions[partition]
        if count > nodes:
            raise WorkerError(f"{count} workers need {count} nodes but partition {partition!r} has {nodes}; ask fewer")
        wanted = self.options.gpus_per_node or gpus
        most = max((int(n) for n in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)), default=0)
        if wanted > most:
            listed_gres = ",".join(sorted({g for g in gres.split(",") if g and g != "(null)"})) or "none"
            raise WorkerError(
                f"{wanted} GPUs per worker, but the nodes of partition {partition!r} have at most {most} "
                f"(gres: {listed_gres}); lower gpus_per_node or choose another partition"
            )
        self._check_account()

    def _check_account(self) -> None:
        account = self.options.account
        if not account:
            return
        try:
            user = f"user={getpass.getuser()}"
            accounts = slurm("sacctmgr", "--noheader", "--parsable2", "show", "assoc", user, "format=account")
        except WorkerError as error:  # no accounting database: Slurm itself checks the account at submission
            logger.info("cannot list accounts (%s); Slurm checks %r when the jobs are submitted", error, account)
            return
        if account not in accounts.split():
            raise WorkerError(
                f"no Slurm account {account!r} for {getpass.getuser()}; set account to one of "
                f"{', '.join(sorted(set(accounts.split()))) or 'none'} (sacctmgr show assoc)"
            )

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        if self.pod_key is None:  # called with the run's token rather than by start_workers
            self.pod_key = partial(pod_key, env.get(c.ENV_TOKEN) or read_token(Path(env[c.ENV_TOKEN_FILE])))
        self._gpus = resources.gpus
        self.check(len(self._jobs) + count, resources.gpus)
        run_name = self.workdir.parent.name if self.workdir else "run"
        self.run_id = self.run_id or f"{re.sub(r'[^A-Za-z0-9_.-]', '-', run_name)[:40]}-{secrets.token_hex(3)}"
        self._env = {key: value for key, value in env.items() if key not in (c.ENV_TOKEN, c.ENV_TOKEN_FILE)}
        self._resources = resources
        start = len(self._jobs)
        for index in range(start, start + count):
            self._submit(f"{JOB_PREFIX}{self.run_id}-{index}")
        logger.info("submitted %d Slurm worker jobs: %s", count, " ".join(self._jobs.values()))
        return self.pods[start:]

    def _submit(self, pod: str) -> None:
        workdir = private_dir(self.workdir) if self.workdir else None
        log = f"{workdir}/{pod}.log" if workdir else "/dev/null"
        environment = self._job_environment(pod, workdir)
        arguments = [
            # Only these names reach the job (sbatch's default, ALL, is the whole environment of the submission).
            f"--export={','.join(sorted(environment))}",
            f"--job-name={pod}",
            "--nodes=1",
            "--ntasks=1",
            f"--cpus-per-task={max(1, math.ceil(self._resources.cpu))}",
            f"--mem={max(1, math.ceil(self._resources.memory_gb * 1024))}M",
            "--no-requeue",
            f"--output={log}",
            "--open-mode=append",
            f"--chdir={os.getcwd()}",
            *self.options.sbatch_arguments(self._gpus),
        ]
        script = f"#!/bin/sh\nexec {shlex.quote(self.python)} -m worker.backends.slurm_node\n"
        job = slurm("sbatch", "--parsable", *arguments, env=environment, stdin=script).strip().split(";")[0]
        self._jobs[pod] = job

    def _job_environment(self, pod: str, workdir: Path | None) -> dict[str, str]:
        """A job's whole environment, an allow-list: the runtime's variables, the cluster's ``SLURM_CONF``, the
        run's settings and this pod's own name and key. The master's credentials (store, tracking, hub) stay here.

        :raises WorkerError: for a variable name sbatch's ``--export`` cannot carry.
        """
        assert self.pod_key is not None, "launch() sets pod_key before any job is submitted"
        environment = inherited_environment()
        if _CLUSTER_CONF in os.environ:
            environment[_CLUSTER_CONF] = os.environ[_CLUSTER_CONF]
        # The key travels in sbatch's environment (kept by slurmctld for the job), never on a command line.
        environment |= self._env | {c.ENV_POD: pod, c.ENV_TOKEN: self.pod_key(pod)}
        if workdir:
            environment[c.ENV_WORKER_DIR] = f"{workdir}/{pod}"
        unexportable = sorted(name for name in environment if not _EXPORTABLE.fullmatch(name))
        if unexportable:
            raise WorkerError(
                f"cannot pass {', '.join(map(repr, unexportable))} to the Slurm jobs (sbatch --export takes names of "
                "letters, digits and underscores); rename the variable in the run's env"
            )
        return environment

    def wait(self, timeout: float) -> None:
        """Until every job runs; a pending one's reason is logged once each time it changes (the terminal and the
        notebook show it), and pending jobs are cancelled at ``timeout``.

        :raises WorkerError: one line naming the jobs that ended, or those still pending and their reasons.
        """
        deadline = time.monotonic() + timeout
        while self._jobs:
            jobs = queue()
            ended = self._ended_jobs(jobs)
            if ended:
                raise WorkerError(f"Slurm worker jobs ended before registering: {'; '.join(ended.values())}")
            pending = {pod: jobs[job] for pod, job in self._jobs.items() if jobs[job][1] != "RUNNING"}
            waited = time.monotonic() - (deadline - timeout)
            for pod, (_, state, reason, _) in pending.items():
                # The first moments' reasons (None, Priority) only say the scheduler has not looked yet.
                if waited >= REPORT_AFTER_S and reason != "None" and self._reasons.get(pod) != reason:
                    self._reasons[pod] = reason
                    logger.warning("Slurm job %s (%s) is %s: %s", self._jobs[pod], pod, state.lower(), reason)
            if not pending:
                return
            if time.monotonic() >= deadline:
                described = ", ".join(f"{pod} (job {self._jobs[pod]}: {why[2]})" for pod, why in pending.items())
                self._cancel(list(pending))
                raise WorkerError(
                    f"Slurm worker jobs still pending after {timeout:.0f}s: {described}; cancelled them "
                    "(check sinfo for free nodes, or a longer timeout)"
                )
            time.sleep(self.options.poll_s)

    def _ended_jobs(self, jobs: dict[str, tuple[str, str, str, str]]) -> dict[str, str]:
        """This run's jobs that ended (or left the queue) without being stopped: pod -> why, its log's last line."""
        ended = {}
        for pod, job in self._jobs.items():
            if job in jobs and jobs[job][1] in ACTIVE:
                continue
            if job in jobs:
                _, state_name, reason, nodes = jobs[job]
                # Slurm's reason says why a job that never ran its script ended (a launch failure, say).
                why = f" ({reason})" if reason not in ("None", "") else ""
                state = f"ended {state_name}{why} on {nodes or 'no node'}"
            else:
                state = "left the queue"
            log = self.workdir / f"{pod}.log" if self.workdir else None
            said = f": {last_line(log)}" if log is not None and log.exists() else ""
            ended[pod] = f"job {job} {state}{said}"
        return ended

    def failures(self) -> dict[str, str]:
        return self._ended_jobs(queue()) if self._jobs else {}

    def replace(self, pod: str, timeout: float) -> WorkerHandle:
        """Cancel ``pod``'s job if it still runs and submit one like it, named ``textsql-RUN-N-rK``.

        Slurm places it on any node the options allow (the lost one too, once it is back); it registers at that
        node's address with a new host key. A replacement that waits for a node says why in the log, and is
        cancelled when the caller's wait ends.

        :param pod: the lost worker's job name.
        :param timeout: unused: the caller waits for the job to run (:meth:`wait`) and register.
        :rtype: WorkerHandle
        :raises WorkerError: if ``pod`` is not one of this run's workers.
        """
        if pod not in self._jobs:
            raise WorkerError(
                f"no Slurm worker {pod!r} of this run to replace; workers: {', '.join(self._jobs) or 'none'}"
            )
        self._cancel([pod])
        self._replaced += 1
        replacement = f"{re.sub(r'-r[0-9]+$', '', pod)}-r{self._replaced}"
        self._submit(replacement)
        logger.info("replaced Slurm worker %s with %s (job %s)", pod, replacement, self._jobs[replacement])
        return WorkerHandle(replacement, f"job {self._jobs[replacement]}, replaces {pod}")

    def _cancel(self, pods: list[str]) -> None:
        jobs = [self._jobs.pop(pod) for pod in pods if pod in self._jobs]
        if jobs:
            try:
                slurm("scancel", "--quiet", *jobs)  # --quiet: a job that already ended is what cancelling wanted
            except WorkerError as error:
                logger.warning("%s; `textsql workers cleanup --backend slurm` cancels them by name", error)
            self._cancelled.update(jobs)

    def stop(self) -> None:
        """Cancel every job of the run and wait, up to ``3 * STOP_GRACE_S``, until none holds a node (Slurm sends
        SIGTERM, then SIGKILL after its ``KillWait``): a run that ended leaves nothing in ``squeue`` but ended jobs."""
        self._cancel(list(self._jobs))
        deadline = time.monotonic() + 3 * c.STOP_GRACE_S
        while self._cancelled and time.monotonic() < deadline:
            try:
                jobs = queue()
            except WorkerError:
                return
            if not any(jobs.get(job, ("", "GONE"))[1] in ACTIVE | {"COMPLETING"} for job in self._cancelled):
                logger.info("cancelled %d Slurm worker jobs", len(self._cancelled))
                self._cancelled = set()
                return
            time.sleep(self.options.poll_s)


def cleanup(run_id: str | None = None) -> list[str]:
    """Cancel this user's worker jobs of one run (or of every run), found by their names (``textsql-RUN-...``).

    :param run_id: the run's id (in the job names; None: every textsql worker job of this user).
    :rtype: list[str]
    :returns: the ids of the jobs cancelled.
    """
    prefix = JOB_PREFIX + (f"{run_id}-" if run_id else "")
    jobs = [job for job, (name, state, _, _) in queue().items() if name.startswith(prefix) and state in ACTIVE]
    if jobs:
        slurm("scancel", "--quiet", *jobs)
    logger.info("cancelled %d Slurm jobs named %s*", len(jobs), prefix)
    return jobs
