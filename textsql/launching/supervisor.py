"""Keep one training run going through lost workers: relaunch from the newest complete checkpoint.

DeepSpeed's pdsh launcher ends the whole job on any failing rank, and its elastic mode does not work
with torch 2; so the process that owns the workers and the launch supervises it. After a failed
:func:`textsql.launching.launch.launch` (which has already ended every rank of that launch on every host) the
failure is classified:

- **worker lost**: its agent hung up on the rendezvous or the backend saw its pod end
  (:meth:`worker.cluster.Cluster.lost`), ssh to it failed (pdsh's exit code 255), or a rank was
  killed by a signal other than the SIGTERM/SIGINT this side sends (SIGKILL: the OOM killer, an
  eviction). A worker that is gone or does not answer over ssh is replaced through the backend
  (:meth:`worker.cluster.Cluster.replace_worker`); one whose rank alone was killed is reused. Then
  the run is launched again with ``--resume auto``. When no replacement registers within
  ``replace_timeout`` and at least ``min_workers`` remain, the run goes on without it (see *Shrinking*).
- **application error**: a rank raised (its traceback's last line) or exited non-zero by itself. It
  is retried once, in case it was a consequence of something passing; the same error twice ends the
  run with that error.
- **stall**: no rank advanced for ``stall_timeout`` seconds (:mod:`textsql.launching.stall`: by default a few
  times the slowest step seen, at least 2 minutes, never counting the first step). Every rank is ended at
  once and the run is relaunched as for a lost worker; the event names the hosts whose ranks stopped
  beating (all of them when every rank is alive but none advances). The ranks' process-group timeout
  (``ddp_timeout``) is bounded too (:func:`process_group_timeout`), so a collective gives up soon after
  the stall is seen rather than 30 minutes later.

**Shrinking.** ``min_workers`` below the number of workers lets a run continue on fewer: the lost
worker is dropped (:meth:`worker.cluster.Cluster.without_worker`), the newest complete checkpoint is
converted for the new data-parallel size where its ZeRO stage needs it (:mod:`textsql.training.universal`),
and the relaunch keeps the global batch (per-rank batch x gradient accumulation x ranks, or the tokens
of a step with a token budget) and the order of the examples. A replacement that arrives later is not
waited for. With ``min_workers`` equal to the number of workers (the default) a lost worker that is
not replaced ends the run, as before.

**Hosts of a hostfile** (``textsql launch --hostfile``, no :class:`worker.cluster.Cluster` in this process) are
the same to the supervisor (:class:`textsql.launching.hostfile_hosts.HostfileHosts`): a lost host is "replaced"
by waiting up to ``replace_timeout`` for it to answer ssh again, and dropped by writing the hosts left to
``RUN_DIR/hostfile.remaining``, which the relaunch uses; the user's hostfile is left as it was.

Each event is one line on the launch's stream and a record in ``RUN_DIR/supervisor.json``, as it
happens: ``worker lost at step N (how), detected after T s`` (T: from the last step logged, or the
launch's start, to the first sign of the failure on the stream: an upper bound of how long it went
unnoticed), ``replacement for HOST registered``, ``relaunching ... from checkpoint-M`` and, at the
relaunch's first step, ``resumed from checkpoint-M``. A run that finishes carries the same records in
its ``run.json`` (key ``recovery``).

Usage::

    >>> with start_workers("local", 2, "runs/r1") as cluster:
    ...     supervise(LaunchArguments(run_dir=cluster.run_dir, train_args=[...]), cluster, max_restarts=3)
    0
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Any

from textsql.arguments import train_argv
from textsql.console import SanitizedLines, TextSink
from textsql.constants import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_REPLACE_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    RUN_SUMMARY_NAME,
)
from textsql.display.step_bar import shown_output
from textsql.errors import LaunchError
from textsql.files import read_json, write_json
from textsql.launching.cluster_check import check_cluster
from textsql.launching.command import TRAIN_MODULE, LaunchArguments
from textsql.launching.hostfile_hosts import HostfileHosts, Workers
from textsql.launching.launch import PDSH_HOST_FAILED, launch
from textsql.launching.stall import SHORTEST_STALL_TIMEOUT_S, StallDetector
from textsql.rank_lines import STEP_LINE, split_host_prefix
from textsql.sanitize import sanitized
from textsql.training.checkpoints import SET_ASIDE_PREFIX, incomplete_newer, newest_complete_checkpoint
from textsql.training.universal import convert, needs_conversion
from worker.cluster import Cluster
from worker.constants import HOSTFILE_NAME
from worker.errors import WorkerError
from worker.files import atomic_write
from worker.hostfile import read_hostfile

logger = logging.getLogger(__name__)

SUPERVISOR_FILE = "supervisor.json"
# The ranks' process-group timeout with the default stall timeout (torch's own is 30 minutes).
PROCESS_GROUP_TIMEOUT_S = 600
# Seconds an ssh check of a suspect worker may take.
SSH_CHECK_S = 15.0
# pdsh's exit code when ssh itself failed: the host is unreachable or its sshd is gone.
SSH_FAILED = 255
# Signals this side sends when it ends a launch's ranks (textsql.launching.ranks, an interrupt): not a loss.
OWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# DeepSpeed's launch.py on a host, when one of its ranks failed: the rank's own return code.
RANK_RETURN = re.compile(r"exits with return code = (?P<code>-?\d+)")
# A DeepSpeed launcher log line ("[2025-01-01 10:00:00,000] [INFO] ..."): never a rank's own last word.
LAUNCHER_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d ")
TRACEBACK = "Traceback (most recent call last):"
# Tracebacks that end in these are a process leaving as told (DeepSpeed's launch.py handling the SIGTERM
# this side sends, an interrupt), never a rank's own error.
NOT_A_CAUSE = re.compile(r"^(SystemExit|KeyboardInterrupt)\b")
# torch's prefix on what a rank writes to stderr once its process group exists.
TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
# What a rank raises when a peer died first (gloo, NCCL, sockets): the peer's own error is the cause,
# and which of the two is seen first depends on timing.
PEER_FAILURE = re.compile(
    r"closed by peer|reset by peer|remote worker crash|DistBackendError|Broken pipe|communicator was aborted",
    re.IGNORECASE,
)


class FailureKind(str, Enum):
    """What made a launch fail (see the module docstring); the value is the event's name in the records."""

    WORKER_LOST = "worker lost"
    APPLICATION_ERROR = "application error"
    STALL = "stall"


@dataclass(frozen=True)
class Failure:
    """Why a launch failed; ``message`` says what happened (for an application error, the rank's
    exception line: the same message twice is the same error)."""

    kind: FailureKind
    host: str | None
    code: int
    message: str

    def line(self, step: int | None, detected: float) -> str:
        """The event's line for a person: what, at which step, how soon it was seen."""
        at = f"at step {step}" if step is not None else "before the first step"
        if self.kind is FailureKind.WORKER_LOST:
            return f"worker lost {at} ({self.message}), detected after {detected:.1f} s"
        if self.kind is FailureKind.STALL:
            return f"stall {at}: {self.message}; every rank ended"
        return f"application error {at} on {self.host or 'this machine'}: {self.message} (exit code {self.code})"


def killing_signal(code: int) -> int | None:
    """The signal that ended a process, from an exit status: a shell's ``128+N``, DeepSpeed's
    launch.py's ``sys.exit(-N)`` (``256-N``), or Popen's ``-N``; None for an ordinary exit.

    :param code: the exit status.
    :rtype: int | None
    """
    if code < 0:
        return -code
    if 128 < code < 128 + 64:
        return code - 128
    if 256 - 64 < code < SSH_FAILED:
        return 256 - code
    return None


class LaunchWatch:
    """The stream :func:`textsql.launching.launch.launch` writes to: passes every line on, and keeps what tells
    one failure from another (per host: exit codes, killing signals, the last exception line)."""

    def __init__(
        self,
        stream: TextSink,
        hosts: list[str],
        on_first_step: Callable[[int], None] | None = None,
        detector: StallDetector | None = None,
    ) -> None:
        """
        :param stream: where the lines go on to.
        :param hosts: the launch's hosts in the hostfile's order (pdsh prefixes each line with ``host: ``; the first
            runs rank 0); empty for the local launcher.
        :param on_first_step: called with the step number of the launch's first ``step N/M`` line (rank 0's).
        :param detector: reads every line for progress; :meth:`stalled` asks it.
        """
        self.stream, self.hosts, self.on_first_step = stream, list(hosts), on_first_step
        self.detector = detector or StallDetector()
        # When this side found the launch stalled (and told it to stop), and the stall's failure.
        self.stall: Failure | None = None
        self.exits: list[tuple[str | None, int]] = []
        self.errors: dict[str | None, str] = {}
        self.last: dict[str | None, str] = {}
        self.first_failure_at: float | None = None
        self.started_at = time.time()
        # The last step rank 0 logged, and when this side read it: the last sign of progress.
        self.step: int | None = None
        self.step_at: float | None = None
        self._in_traceback: set[str | None] = set()
        self._partial = ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._read(line)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def stalled(self) -> bool:
        """Whether the launch has stalled (the launch's ``should_stop``); the first time, the stall is recorded.

        :rtype: bool
        """
        if self.stall is None and self.detector.stalled():
            hosts = [host or "this machine" for host in self.detector.stalled_hosts()] or ["this machine"]
            self.first_failure_at = time.time()
            self.stall = Failure(
                FailureKind.STALL,
                hosts[0],
                0,
                f"{self.detector.summary()}; stalled: {', '.join(hosts)}",
            )
        return self.stall is not None

    def _read(self, line: str) -> None:
        # What is kept from here (failure messages, events, supervisor.json) is shown to a person: inert.
        line = sanitized(line)
        self.detector.read(line)
        failed = PDSH_HOST_FAILED.match(line)
        if failed:
            self._exit(failed["host"], int(failed["code"]))
            return
        host, text = split_host_prefix(line, self.hosts)
        text = TORCH_RANK_PREFIX.sub("", text)
        stepped = STEP_LINE.match(text)
        # Only rank 0 prints steps: the same line from another host is not its word.
        if stepped and host == (self.hosts[0] if self.hosts else None):
            self._step(int(stepped["step"]))
        returned = RANK_RETURN.search(text)
        if returned and killing_signal(int(returned["code"])):
            self._exit(host, int(returned["code"]))
        if text.startswith(TRACEBACK):
            self._in_traceback.add(host)
        elif host in self._in_traceback and text and not text[0].isspace():
            # The first unindented line after the frames: "SomeError: message".
            if not NOT_A_CAUSE.match(text):
                self.errors[host] = text
            self._in_traceback.discard(host)
        elif text.strip() and not LAUNCHER_LOG.match(text):
            self.last[host] = text.strip()

    def _step(self, step: int) -> None:
        first = self.step is None
        self.step, self.step_at = step, time.time()
        if first and self.on_first_step is not None:
            self.on_first_step(step)

    def _exit(self, host: str | None, code: int) -> None:
        if self.first_failure_at is None:
            self.first_failure_at = time.time()
        self.exits.append((host, code))


def classify(code: int, watch: LaunchWatch, lost: dict[str, str]) -> Failure:
    """Tell a lost worker from an application error (see the module docstring).

    :param code: what :func:`textsql.launching.launch.launch` returned.
    :param watch: what the launch printed.
    :param lost: workers the rendezvous or the backend know to be gone (address -> why).
    :rtype: Failure
    """
    if watch.stall is not None:
        # The ranks were ended by this side because they stalled: whatever they said on the way out is no cause.
        return replace(watch.stall, code=code)
    host: str | None
    if lost:
        host, reason = next(iter(sorted(lost.items())))
        return Failure(FailureKind.WORKER_LOST, host, code, reason)
    # ssh also exits 255 when the launch's processes on a host were ended by signal, as this side ends
    # every host's after the first failure: a later 255 is no loss unless nothing else explains the failure.
    if watch.exits and watch.exits[0][1] == SSH_FAILED:
        return _ssh_failed(watch.exits[0][0])
    # A rank that raised its own error is the cause: ranks still running then are ended by us, and on
    # a loaded machine some only go with SIGKILL, which must not read as a lost worker.
    causes = [(failed, error) for failed, error in watch.errors.items() if not PEER_FAILURE.search(error)]
    if causes:
        return Failure(FailureKind.APPLICATION_ERROR, causes[0][0], code, causes[0][1])
    for host, exit_code in watch.exits:
        signum = killing_signal(exit_code)
        if signum is not None and signum not in OWN_SIGNALS:
            return Failure(
                FailureKind.WORKER_LOST,
                host,
                exit_code,
                f"a rank on {host or 'this machine'} was killed by {_signal_name(signum)}",
            )
    unreachable = next((host for host, exit_code in watch.exits if exit_code == SSH_FAILED), None)
    if unreachable is not None and all(PEER_FAILURE.search(error) for error in watch.errors.values()):
        return _ssh_failed(unreachable)
    host = watch.exits[0][0] if watch.exits else None
    message = (
        watch.errors.get(host) or next(iter(watch.errors.values()), None) or watch.last.get(host) or f"exit code {code}"
    )
    return Failure(FailureKind.APPLICATION_ERROR, host, code, message)


@dataclass(frozen=True)
class TrainingPlan:
    """What the supervisor reads of the ranks' training arguments, parsed by the ranks' own parser
    (:func:`textsql.training.command_line.parse_command_line`); None fields for another module."""

    output_dir: Path | None = None
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_tokens_per_batch: int | None = None
    length_group_size: int | None = None
    model: str | None = None
    ddp_timeout: int | None = None

    @classmethod
    def read(cls, arguments: LaunchArguments) -> TrainingPlan:
        """The plan of a launch of the training module (an empty one for any other module).

        :rtype: TrainingPlan
        """
        if arguments.module != TRAIN_MODULE:
            return cls()
        from textsql.training.command_line import parse_command_line

        model_args, data_args, _, training = parse_command_line(arguments.train_args)
        return cls(
            Path(training["output_dir"]),
            training["per_device_train_batch_size"],
            training["gradient_accumulation_steps"],
            data_args.max_tokens_per_batch,
            data_args.length_group_size,
            model_args.model,
            training["ddp_timeout"],
        )

    def batch_for(self, first_world: int, world: int) -> dict[str, Any]:
        """Training arguments that keep the first launch's global batch and data order on ``world`` ranks.

        Examples per step: the per-rank batch shrinks to the largest divisor of the new per-rank share
        not above the old batch (no rank holds more at once than before), gradient accumulation makes up
        the rest, and the length groups keep their first size. With a token budget, accumulation grows to
        cover the lost ranks and the budget is cut so a step holds at most the tokens it held.

        :param first_world: ranks of the first launch.
        :param world: ranks now.
        :rtype: dict[str, typing.Any]
        :raises LaunchError: when the global batch does not divide among ``world`` ranks.
        """
        if world == first_world:
            return {}
        if self.max_tokens_per_batch:
            steps = math.ceil(self.gradient_accumulation_steps * first_world / world)
            budget = self.max_tokens_per_batch * self.gradient_accumulation_steps * first_world // (world * steps)
            return {"max_tokens_per_batch": budget, "gradient_accumulation_steps": steps}
        per_rank, rest = divmod(
            self.per_device_train_batch_size * self.gradient_accumulation_steps * first_world, world
        )
        if rest:
            raise LaunchError(
                f"the global batch of {per_rank * world + rest} questions does not divide among {world} ranks; "
                "pick a per-rank batch x workers that the smaller world divides, or min_workers = workers"
            )
        batch = max(size for size in range(1, self.per_device_train_batch_size + 1) if per_rank % size == 0)
        return {
            "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": per_rank // batch,
            "length_group_size": self.length_group_size
            or self.per_device_train_batch_size * self.gradient_accumulation_steps,
        }


@dataclass
class Supervisor:
    """Runs :func:`textsql.launching.launch.launch` until it succeeds, replacing lost workers, at most
    ``max_restarts`` times after the first launch (0: the first failure ends the run, as without it).

    ``min_workers`` (default: all the workers) is the fewest the run may go on with when a lost worker's
    replacement does not register within ``replace_timeout`` seconds. ``stall_timeout`` (None: the
    default of :mod:`textsql.launching.stall`) is how long no rank may advance before the run counts as stalled.

    Methods that may be overridden: :meth:`recover` (what to do about a failure before the relaunch).
    """

    arguments: LaunchArguments
    cluster: Workers | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    replace_timeout: float = DEFAULT_REPLACE_TIMEOUT_S
    min_workers: int | None = None
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S
    stream: TextSink = field(default_factory=lambda: SanitizedLines(sys.stdout))
    events: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts {self.max_restarts!r} must be 0 or more")
        if self.cluster is None and self.arguments.launcher == "pdsh":
            # An existing hostfile's hosts: waited for and left behind as a cluster's workers are replaced and dropped.
            self.cluster = HostfileHosts.read(self.arguments)
        if self.cluster is not None and self.arguments.hostfile is None:
            # The cluster's files, wherever they live (off the shared volume for cml and kubernetes workers).
            self.arguments = replace(
                self.arguments,
                hostfile=self.cluster.hostfile,
                ssh_config=self.arguments.ssh_config or self.cluster.ssh_config,
            )
        workers = len(self.cluster.hosts) if self.cluster is not None else len(self._hosts()) or 1
        if self.min_workers is None:
            self.min_workers = workers
        if not 1 <= self.min_workers <= workers:
            raise LaunchError(f"--min-workers {self.min_workers!r} must be from 1 to the number of workers ({workers})")
        if self.replace_timeout < 0:
            raise LaunchError(f"--replace-timeout {self.replace_timeout!r} must be 0 or more seconds")
        if self.stall_timeout is not None and self.stall_timeout < SHORTEST_STALL_TIMEOUT_S:
            raise LaunchError(
                f"--stall-timeout {self.stall_timeout!r} must be at least {SHORTEST_STALL_TIMEOUT_S:g} seconds "
                "(or left out for the default)"
            )
        self.plan = TrainingPlan.read(self.arguments)
        self.first_world = self._world()
        # Training arguments on top of the user's for the next launch (the last of a flag wins).
        self.overrides: dict[str, Any] = {}
        bound = process_group_timeout(self.stall_timeout)
        if self.plan.ddp_timeout is not None and self.plan.ddp_timeout > bound:
            self.overrides["ddp_timeout"] = bound

    def run(self) -> int:
        """Launch, and relaunch after each recoverable failure.

        :rtype: int
        :returns: 0, or the last launch's exit code once the restarts are used up.
        :raises LaunchError: when a rank fails with the same error twice in a row (its message), or a
            checkpoint cannot be converted for fewer workers.
        :raises WorkerError: when a lost worker's replacement was not running and registered in time
            and the run may not go on with fewer workers.
        """
        previous, aware_at = None, None
        for attempt in range(self.max_restarts + 1):
            resumed_from = self._checkpoint() if attempt else None
            watch = LaunchWatch(
                self.stream,
                self._hosts(),
                on_first_step=self._on_relaunch_first_step(attempt, resumed_from, aware_at) if attempt else None,
                detector=StallDetector(self.stall_timeout, hosts=self._hostfile()),
            )
            code = launch(self._launch_arguments(), stream=watch, should_stop=watch.stalled)
            if code == 0:
                if attempt:
                    self._event("finished", attempt, f"run finished after {attempt} restart(s)")
                self._record_in_summary(attempt)
                return 0
            failure = classify(code, watch, self.cluster.lost() if self.cluster is not None else {})
            aware_at = watch.first_failure_at or time.time()
            detected = max(0.0, aware_at - (watch.step_at or watch.started_at))
            self._event(
                failure.kind.value,
                attempt,
                failure.line(watch.step, detected),
                host=failure.host,
                code=failure.code,
                message=failure.message,
                step=watch.step,
                aware_at=aware_at,
                detected_s=round(detected, 2),
            )
            if failure.kind is FailureKind.APPLICATION_ERROR and previous == (failure.kind, failure.message):
                self._event("gave up", attempt, f"the same error twice, not retried again: {failure.message}")
                raise LaunchError(failure.message)
            if attempt == self.max_restarts:
                break
            self.recover(failure, attempt)
            previous = failure.kind, failure.message
            self.overrides |= {"resume": "auto", "overwrite_output_dir": False}
            self._relaunch_event(attempt)
        if self.max_restarts:
            self._event("gave up", self.max_restarts, f"{self.max_restarts} restart(s) used up; exit code {code}")
        return code

    def recover(self, failure: Failure, attempt: int) -> None:
        """Replace the failed worker when it is gone or does not answer (a worker whose rank alone was
        killed is reused); without a replacement in time, go on without it when ``min_workers`` allows."""
        if (
            failure.kind not in (FailureKind.WORKER_LOST, FailureKind.STALL)
            or self.cluster is None
            or failure.host not in self.cluster.hosts
        ):
            return
        gone = failure.host in self.cluster.lost() or not self._answers(failure.host)
        if not gone:
            return
        started = time.monotonic()
        try:
            self.cluster = self.cluster.replace_worker(failure.host, self.replace_timeout)
        except WorkerError as error:
            assert self.min_workers is not None  # set by __post_init__
            if len(self.cluster.hosts) - 1 < self.min_workers:
                raise WorkerError(
                    f"{error}; going on without it would leave {len(self.cluster.hosts) - 1} worker(s), "
                    f"fewer than --min-workers {self.min_workers} (lower it to go on with fewer)"
                ) from None
            self._shrink(failure.host, time.monotonic() - started, str(error), attempt)
            return
        self._event(
            "replaced",
            attempt,
            f"replacement for {failure.host} registered after {time.monotonic() - started:.1f} s",
            host=failure.host,
        )

    def _shrink(self, host: str, waited: float, why: str, attempt: int) -> None:
        """Go on without ``host``: keep the global batch on the ranks left, and convert the checkpoint for them."""
        before = self._world()
        after = before - self._hostfile().get(host, 0)
        # Checked before the worker is dropped: a batch that cannot be kept ends the run as before.
        batch = self.plan.batch_for(self.first_world, after)
        assert self.cluster is not None  # only recover() shrinks, and only a cluster
        given = self.cluster.hostfile
        self.cluster = self.cluster.without_worker(host)
        # A cluster rewrote its own hostfile; a hostfile run goes on with a new one (HostfileHosts).
        self.arguments = replace(self.arguments, hostfile=self.cluster.hostfile)
        moved = (
            f"; the hosts left are in {self.cluster.hostfile} ({given} unchanged)"
            if given != self.cluster.hostfile
            else ""
        )
        self.overrides |= batch
        checkpoint = self._checkpoint()
        converted_s = None
        if checkpoint is not None and needs_conversion(Path(checkpoint), after):
            try:
                # On a worker that goes on, never here: see textsql.training.universal.
                converted_s = convert(
                    Path(checkpoint), on_worker=partial(self.cluster.ssh_command, self.cluster.hosts[0])
                )
            except LaunchError as error:
                self._event("gave up", attempt, str(error), checkpoint=checkpoint)
                raise
        origin = (
            f"from {Path(checkpoint).name}"
            + (f" (converted in {converted_s:.1f} s)" if converted_s is not None else "")
            if checkpoint
            else "from the start"
        )
        self._event(
            "shrunk",
            attempt,
            f"worker {host} lost, no replacement after {waited:.1f} s; "
            f"continuing on {len(self.cluster.hosts)} workers {origin}{moved}",
            host=host,
            hostfile=str(self.cluster.hostfile),
            reason=why,
            world_size_before=before,
            world_size_after=after,
            checkpoint=checkpoint,
            converted_s=round(converted_s, 2) if converted_s is not None else None,
            overrides=dict(self.overrides),
        )

    def _relaunch_event(self, attempt: int) -> None:
        checkpoint, incomplete = self._checkpoint(), self._incomplete()
        skipped = "".join(
            f"; {path.name} is incomplete ({reason}): set aside as {SET_ASIDE_PREFIX}{path.name}"
            for path, reason in incomplete
        )
        self._event(
            "relaunch",
            attempt + 1,
            f"relaunching (restart {attempt + 1} of {self.max_restarts}) "
            f"from {Path(checkpoint).name if checkpoint else 'the start: no complete checkpoint yet'}{skipped}",
            checkpoint=checkpoint,
            incomplete=[str(path) for path, _ in incomplete],
        )

    def _launch_arguments(self) -> LaunchArguments:
        """The user's launch with the supervisor's overrides after the user's training arguments."""
        if not self.overrides:
            return self.arguments
        return replace(self.arguments, train_args=[*self.arguments.train_args, *train_argv(**self.overrides)])

    def _on_relaunch_first_step(
        self, attempt: int, checkpoint: str | None, aware_at: float | None
    ) -> Callable[[int], None]:
        """The relaunch's first step: the run is going again (its time, less the failure's, is the downtime seen here)."""

        def resumed_at(step: int) -> None:
            since = time.time() - (aware_at or time.time())
            origin = f"from {Path(checkpoint).name}" if checkpoint else "from the start"
            self._event(
                "resumed",
                attempt,
                f"resumed {origin}: step {step} done {since:.1f} s after the failure was detected",
                checkpoint=checkpoint,
                step=step,
                world_size=self._world(),
                first_step_at=time.time(),
            )

        return resumed_at

    def _record_in_summary(self, restarts: int) -> None:
        """Copy the events into the finished run's ``run.json`` (which the ranks wrote without them)."""
        summary = self.plan.output_dir / RUN_SUMMARY_NAME if self.plan.output_dir else None
        if summary is not None and summary.is_file():
            record = read_json(summary)
            record["recovery"] = {
                "max_restarts": self.max_restarts,
                "restarts": restarts,
                "min_workers": self.min_workers,
                "world_size_first": self.first_world,
                "events": self.events,
            }
            write_json(summary, record)

    def _answers(self, host: str) -> bool:
        assert self.cluster is not None  # only recover() asks, and only of a cluster's worker
        return self.cluster.answers(host, timeout=SSH_CHECK_S)

    def _hostfile(self) -> dict[str, int]:
        if self.arguments.launcher != "pdsh":
            return {}
        return read_hostfile((self.arguments.hostfile or self.arguments.run_dir / HOSTFILE_NAME).resolve())

    def _hosts(self) -> list[str]:
        return list(self._hostfile())

    def _world(self) -> int:
        """Ranks of the next launch: the hostfile's slots (for the local launcher: its rank count, or 1)."""
        return sum(self._hostfile().values()) or self.arguments.ranks or 1

    def _checkpoint(self) -> str | None:
        return newest_complete_checkpoint(self.plan.output_dir) if self.plan.output_dir else None

    def _incomplete(self) -> list[tuple[Path, str]]:
        return incomplete_newer(self.plan.output_dir) if self.plan.output_dir else []

    def _event(self, event: str, attempt: int, line: str, **record: Any) -> None:
        self.stream.write(f"[supervisor] {line}\n")
        self.stream.flush()
        self.events.append({"event": event, "attempt": attempt, "time": time.time(), "line": line, **record})
        record = {"max_restarts": self.max_restarts, "events": self.events}
        atomic_write(self.arguments.run_dir / SUPERVISOR_FILE, json.dumps(record, indent=2) + "\n", mode=0o600)


def supervise(
    arguments: LaunchArguments,
    cluster: Cluster | None = None,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    stream: TextSink | None = None,
    min_workers: int | None = None,
    replace_timeout: float = DEFAULT_REPLACE_TIMEOUT_S,
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
) -> int:
    """Run the launch under a :class:`Supervisor` (see the module docstring).

    :param arguments: the launch.
    :param cluster: the run's workers, so lost ones can be replaced (None: the hostfile's hosts, see
        :class:`textsql.launching.hostfile_hosts.HostfileHosts`).
    :param max_restarts: relaunches allowed after the first launch (0: none).
    :param stream: where the ranks' output and the supervisor's lines go (default: sys.stdout; in a notebook
        the step lines move a progress bar, :mod:`textsql.display.step_bar`).
    :param min_workers: the fewest workers to go on with when a lost one is not replaced in time (None: all).
    :param replace_timeout: seconds a replacement has to register.
    :param stall_timeout: seconds no rank may advance before the run is relaunched (None: the default, see
        :mod:`textsql.launching.stall`).
    :rtype: int
    :raises ClusterError: before anything is launched, when the workers cannot train together.
    """
    if cluster is not None:
        check_cluster(cluster.workers, arguments.run_dir, TrainingPlan.read(arguments).model, arguments.socket_ifname)
    with contextlib.nullcontext(stream) if stream is not None else shown_output() as output:
        return Supervisor(
            arguments,
            cluster,
            max_restarts,
            replace_timeout=replace_timeout,
            min_workers=min_workers,
            stall_timeout=stall_timeout,
            stream=output,
        ).run()


def process_group_timeout(stall_timeout: float | None) -> int:
    """The ranks' ``ddp_timeout`` under the supervisor: twice a given stall timeout (a collective that gave up
    first would read as a crash, and a rank's wait starts only after its last progress), else
    :data:`PROCESS_GROUP_TIMEOUT_S`, which still ends a default-timeout stall long before torch's 30 minutes.

    :rtype: int
    """
    return math.ceil(2 * stall_timeout) if stall_timeout is not None else PROCESS_GROUP_TIMEOUT_S


def _ssh_failed(host: str | None) -> Failure:
    return Failure(FailureKind.WORKER_LOST, host, SSH_FAILED, f"ssh to {host} failed (exit code {SSH_FAILED})")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
