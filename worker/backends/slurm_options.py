"""The ``slurm`` backend's options: what notebook 02's ``backend_options`` holds for it, key by key.

Where the worker jobs run (partition, account, constraint), for how long, with how many GPUs, which further
``sbatch`` flags the user may add (an allow-list: a flag that would change how the worker job starts, its
environment or its output is refused), and how often the backend looks at the queue. Each becomes ``sbatch``
arguments in :meth:`SlurmOptions.sbatch_arguments`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from worker.errors import WorkerError

logger = logging.getLogger(__name__)

#: Extra ``sbatch`` flags a user may pass, as ``--flag=value``: placement, accounting and memory. Anything else
#: (``--export``, ``--output``, ``--nodes``, ``--wrap``, ``--array``, ``--uid``...) would change what the worker
#: job runs, where its key goes or how many nodes it holds, which this backend decides.
ALLOWED_SBATCH_FLAGS = frozenset(
    {
        "--qos",
        "--reservation",
        "--exclude",
        "--nodelist",
        "--mem",
        "--mem-per-cpu",
        "--mem-per-gpu",
        "--cpus-per-task",
        "--comment",
        "--mail-type",
        "--mail-user",
        "--licenses",
        "--nice",
        "--wckey",
        "--begin",
    }
)
# Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_seconds(limit: str) -> int:
    """Seconds in a Slurm time limit (``"90"`` minutes, ``"1:30:00"``, ``"2-00:00:00"``).

    :param limit: the limit as ``sbatch --time`` takes it.
    :rtype: int
    :raises WorkerError: if it is not one of Slurm's formats.
    """
    match = _TIME.match(limit.strip())
    if not match:
        raise WorkerError(f"time_limit {limit!r} is not a Slurm time (minutes, HH:MM:SS or D-HH:MM:SS); fix it")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        parts = [int(first), int(second or 0), int(third or 0)]
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    if second is not None:  # MM:SS
        return int(first) * 60 + int(second)
    return int(first) * 60  # minutes


@dataclass(frozen=True)
class SlurmOptions:
    """How the ``slurm`` backend submits its worker jobs.

    Usage (notebook 02; :meth:`~worker.backends.slurm.SlurmBackend.from_options` builds it)::

        backend_options = {"partition": "gpu", "account": "ml", "time_limit": "4:00:00", "gpus_per_node": 4}
    """

    partition: str | None = None
    """The partition (None: the cluster's default one)."""
    account: str | None = None
    """The account charged (None: the user's default account)."""
    time_limit: str | None = None
    """Each worker job's ``--time`` (None: the partition's default); refused before submitting when shorter than
    ``min_time_s``."""
    min_time_s: float | None = None
    """The run's estimated duration in seconds: a ``time_limit`` shorter than this is refused before any job is
    submitted (the workers would be ended mid-run)."""
    gpus_per_node: int = 0
    """GPUs per worker (``--gres=gpu:N``; 0: the notebook's ``worker_gpus``). Each worker runs one rank per GPU."""
    constraint: str | None = None
    """Node features the workers need (``--constraint``, e.g. ``a100``)."""
    sbatch_flags: Sequence[str] = ()
    """Further ``sbatch`` flags, each ``--flag=value``: placement, accounting and memory only (the flags of
    :data:`ALLOWED_SBATCH_FLAGS`, listed on the Slurm page); any other is refused in one line."""
    exclusive: bool = True
    """Each worker holds its node alone (``--exclusive``): two workers of a run must never share a node (one sshd
    port and one address per worker)."""
    poll_s: float = 1.0
    """Seconds between looks at the queue (``squeue``)."""

    def __post_init__(self) -> None:
        if isinstance(self.sbatch_flags, str):
            raise WorkerError(f"sbatch_flags {self.sbatch_flags!r} must be a list of --flag=value strings")
        for flag in self.sbatch_flags:
            name = flag.split("=", 1)[0]
            if name not in ALLOWED_SBATCH_FLAGS or "=" not in flag:
                raise WorkerError(
                    f"sbatch flag {flag!r} is not allowed in sbatch_flags; use --flag=value with one of "
                    f"{', '.join(sorted(ALLOWED_SBATCH_FLAGS))} (partition, account, time and GPUs are options)"
                )
        if self.gpus_per_node < 0:
            raise WorkerError(f"gpus_per_node {self.gpus_per_node!r} must be 0 or more")
        if self.time_limit is not None:
            limit = time_limit_seconds(str(self.time_limit))
            if self.min_time_s is not None and limit < self.min_time_s:
                raise WorkerError(
                    f"time_limit {self.time_limit!r} ({limit} s) is shorter than the run's estimate "
                    f"({self.min_time_s:.0f} s); raise time_limit or shorten the run"
                )

    def sbatch_arguments(self, gpus: int) -> list[str]:
        """The options' ``sbatch`` flags for one worker job.

        :param gpus: GPUs per worker the run asks for (the notebook's ``worker_gpus``), unless ``gpus_per_node``.
        :rtype: list[str]
        """
        arguments = ["--exclusive"] if self.exclusive else []
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--time", self.time_limit),
            ("--constraint", self.constraint),
        ):
            if value:
                arguments.append(f"{flag}={value}")
        if self.gpus_per_node or gpus:
            arguments.append(f"--gres=gpu:{self.gpus_per_node or gpus}")
        return arguments + list(self.sbatch_flags)
