"""The supervisor's recovery decisions: why a launch failed, and what to do before the next one, or to give up.

After a failed :func:`textsql.launching.launch.launch` (which has already ended every rank of that launch on
every host) the failure is classified (:func:`classify`):

- **worker lost**: its agent hung up on the rendezvous or the backend saw its pod end
  (:meth:`worker.cluster.Cluster.lost`), ssh to it failed (pdsh's exit code 255), or a rank was
  killed by a signal other than the SIGTERM/SIGINT this side sends (SIGKILL: the OOM killer, an
  eviction). A worker that is gone or does not answer over ssh is replaced through the backend
  (:meth:`worker.cluster.Cluster.replace_worker`); one whose rank alone was killed is reused. Then
  the run is launched again with ``--resume-from-checkpoint auto``. When no replacement registers within
  ``replace_timeout`` and at least ``min_workers`` remain, the run goes on without it (see *Shrinking*).
- **application error**: a rank raised (its traceback's last line) or exited non-zero by itself. It
  is retried once, in case it was a consequence of something passing; the same error twice ends the
  run with that error.
- **stall**: no rank advanced for ``stall_timeout`` seconds (:mod:`textsql.launching.stall`: by default a few
  times the slowest step seen, at least 2 minutes, never counting the first step). Every rank is ended at
  once and the run is relaunched as for a lost worker; the event names the hosts whose ranks stopped
  beating (all of them when every rank is alive but none advances).

Every relaunch resumes from the newest complete checkpoint (incomplete newer ones are set aside), at most
``max_restarts`` times; then the run gives up with the last launch's exit code.

**Shrinking.** ``min_workers`` below the number of workers lets a run go on with fewer: the lost
worker is dropped (:meth:`worker.cluster.Cluster.without_worker`), the newest complete checkpoint is
converted for the new data-parallel size where its ZeRO stage needs it (:mod:`textsql.rundir.universal`),
and the relaunch keeps the global batch (per-rank batch x gradient accumulation x ranks, or the tokens
of a step with a token budget: :meth:`textsql.launching.training_plan.TrainingPlan.batch_for`) and the order
of the examples. A replacement that arrives later is not waited for. With ``min_workers`` equal to the number
of workers (the default) a lost worker that is not replaced ends the run, as before.

**Hosts of a hostfile** (``textsql launch --hostfile``, no :class:`worker.cluster.Cluster` in this process) are
the same to the supervisor (:class:`ReplaceableHosts`, :class:`textsql.launching.hostfile_hosts.HostfileHosts`):
a lost host is "replaced" by waiting up to ``replace_timeout`` for it to answer ssh again, and dropped by
writing the hosts left to ``RUN_DIR/hostfile.remaining``, which the relaunch uses; the user's hostfile is left
as it was.

Each decision is one ``[supervisor]`` line on the launch's stream and a record in ``RUN_DIR/supervisor.json``,
as it happens (see :mod:`textsql.launching.supervisor` for every event).
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from textsql.console import SanitizedLines, TextSink, counted
from textsql.constants import DEFAULT_MAX_RESTARTS, DEFAULT_REPLACE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.failures import SSH_FAILED, Failure, FailureKind, killing_signal
from textsql.launching.hostfile_hosts import HostfileHosts
from textsql.launching.launch_watch import LaunchWatch
from textsql.launching.stall import SHORTEST_STALL_TIMEOUT_S
from textsql.launching.training_plan import TrainingPlan
from textsql.rundir.checkpoints import SET_ASIDE_PREFIX, incomplete_newer, newest_complete_checkpoint
from textsql.rundir.universal import convert, needs_conversion
from worker.beats import Beat
from worker.constants import HOSTFILE_NAME
from worker.errors import WorkerError
from worker.files import atomic_write
from worker.hostfile import read_hostfile

logger = logging.getLogger(__name__)

SUPERVISOR_FILE = "supervisor.json"
# Seconds an ssh check of a suspect worker may take.
SSH_CHECK_S = 15.0
# Signals this side sends when it ends a launch's ranks (textsql.launching.ranks, an interrupt): not a loss.
OWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# What a rank raises when a peer died first (gloo, NCCL, sockets): the peer's own error is the cause,
# and which of the two is seen first depends on timing.
PEER_FAILURE = re.compile(
    r"closed by peer|reset by peer|remote worker crash|DistBackendError|Broken pipe|communicator was aborted",
    re.IGNORECASE,
)


class ReplaceableHosts(Protocol):
    """The run's hosts as the recovery replaces and drops them, whatever provides them: a
    :class:`worker.cluster.Cluster` this process started (its backend replaces a lost worker), or
    :class:`textsql.launching.hostfile_hosts.HostfileHosts` (a hostfile's host is waited for)."""

    @property
    def hosts(self) -> list[str]: ...

    @property
    def hostfile(self) -> Path: ...

    @property
    def ssh_config(self) -> Path | None: ...

    def lost(self) -> dict[str, str]: ...

    def relay_beats(self, receive: Callable[[str, Beat], None] | None, /) -> frozenset[str]: ...

    def answers(self, host: str, /, timeout: float = ...) -> bool: ...

    def replace_worker(self, host: str, timeout: float, /) -> ReplaceableHosts: ...

    def without_worker(self, host: str, /) -> ReplaceableHosts: ...

    def ssh_command(self, host: str, command: str, /) -> list[str]: ...


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
    # A later 255 is the lost host when all the others said is a peer losing it: their exception lines, or without
    # one (a rank's sys.exit("...") prints no traceback) the last line of each host that exited otherwise.
    unreachable = next((host for host, exit_code in watch.exits if exit_code == SSH_FAILED), None)
    said = list(watch.errors.values()) or [watch.last.get(host, "") for host, code in watch.exits if code != SSH_FAILED]
    if unreachable is not None and all(PEER_FAILURE.search(words) for words in said):
        return _ssh_failed(unreachable)
    host = watch.exits[0][0] if watch.exits else None
    message = (
        watch.errors.get(host) or next(iter(watch.errors.values()), None) or watch.last.get(host) or f"exit code {code}"
    )
    return Failure(FailureKind.APPLICATION_ERROR, host, code, message)


def _ssh_failed(host: str | None) -> Failure:
    return Failure(FailureKind.WORKER_LOST, host, SSH_FAILED, f"ssh to {host} failed (exit code {SSH_FAILED})")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class Recovery:
    """The supervisor's settings, the run's state its decisions change (hosts, launch, training arguments),
    and those decisions after a failed launch; :class:`textsql.launching.supervisor.Supervisor` runs the launches.

    ``min_workers`` (default: all the workers) is the fewest the run may go on with when a lost worker's
    replacement does not register within ``replace_timeout`` seconds. ``stall_timeout`` (None: the
    default of :mod:`textsql.launching.stall`) is how long no rank may advance before the run counts as stalled.

    Methods that may be overridden: :meth:`recover` (what to do about a failure before the relaunch).
    """

    arguments: LaunchArguments
    hosts: ReplaceableHosts | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    replace_timeout: float = DEFAULT_REPLACE_TIMEOUT_S
    min_workers: int | None = None
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S
    stream: TextSink = field(default_factory=lambda: SanitizedLines(sys.stdout))
    events: list[dict] = field(default_factory=list)
    # The launch's training arguments, parsed once (TrainingPlan.read) before the supervisor was made.
    plan: TrainingPlan = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts {self.max_restarts!r} must be 0 or more")
        if self.hosts is None and self.arguments.launcher == "pdsh":
            # An existing hostfile's hosts: waited for and left behind as a cluster's workers are replaced and dropped.
            self.hosts = HostfileHosts.read(self.arguments)
        if self.hosts is not None and self.arguments.hostfile is None:
            # The cluster's files, wherever they live (off the shared volume for cml and kubernetes workers).
            self.arguments = replace(
                self.arguments,
                hostfile=self.hosts.hostfile,
                ssh_config=self.arguments.ssh_config or self.hosts.ssh_config,
            )
        workers = len(self.hosts.hosts) if self.hosts is not None else len(self._hostfile()) or 1
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
        self.first_world = self._world()
        # Training arguments on top of the user's for the next launch (the last of a flag wins).
        self.overrides: dict[str, Any] = {}

    def recover(self, failure: Failure, attempt: int) -> None:
        """Replace the failed worker when it is gone or does not answer (a worker whose rank alone was
        killed is reused); without a replacement in time, go on without it when ``min_workers`` allows."""
        if (
            failure.kind not in (FailureKind.WORKER_LOST, FailureKind.STALL)
            or self.hosts is None
            or failure.host not in self.hosts.hosts
        ):
            return
        gone = failure.host in self.hosts.lost() or not self._answers(failure.host)
        if not gone:
            return
        started = time.monotonic()
        try:
            self.hosts = self.hosts.replace_worker(failure.host, self.replace_timeout)
        except WorkerError as error:
            assert self.min_workers is not None  # set by __post_init__
            if len(self.hosts.hosts) - 1 < self.min_workers:
                raise WorkerError(
                    f"{error}; going on without it would leave {len(self.hosts.hosts) - 1} worker(s), "
                    f"fewer than --min-workers {self.min_workers} (lower it to go on with fewer)"
                ) from None
            self._shrink(failure.host, time.monotonic() - started, str(error), attempt)
            return
        waited = time.monotonic() - started
        # A hostfile's host is the same host back, not a replacement: say so.
        back = (
            f"host {failure.host} answers ssh again after {waited:.1f} s"
            if isinstance(self.hosts, HostfileHosts)
            else f"replacement for {failure.host} registered after {waited:.1f} s"
        )
        self._event("replaced", attempt, back, host=failure.host)

    def _shrink(self, host: str, waited: float, why: str, attempt: int) -> None:
        """Go on without ``host``: keep the global batch on the ranks left, and convert the checkpoint for them."""
        before = self._world()
        after = before - self._hostfile().get(host, 0)
        # Checked before the worker is dropped: a batch that cannot be kept ends the run as before.
        batch = self.plan.batch_for(self.first_world, after)
        assert self.hosts is not None  # only recover() shrinks, and only hosts it can drop
        given = self.hosts.hostfile
        self.hosts = self.hosts.without_worker(host)
        # A cluster rewrote its own hostfile; a hostfile run goes on with a new one (HostfileHosts).
        self.arguments = replace(self.arguments, hostfile=self.hosts.hostfile)
        moved = (
            f"; the hosts left are in {self.hosts.hostfile} ({given} unchanged)" if given != self.hosts.hostfile else ""
        )
        self.overrides |= batch
        checkpoint = self._checkpoint()
        converted_s = None
        if checkpoint is not None and needs_conversion(Path(checkpoint), after):
            try:
                # On a worker that goes on, never here: see textsql.rundir.universal.
                converted_s = convert(Path(checkpoint), on_worker=partial(self.hosts.ssh_command, self.hosts.hosts[0]))
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
            f"going on with {counted(len(self.hosts.hosts), 'worker')} {origin}{moved}",
            host=host,
            hostfile=str(self.hosts.hostfile),
            reason=why,
            world_size_before=before,
            world_size_after=after,
            checkpoint=checkpoint,
            converted_s=round(converted_s, 2) if converted_s is not None else None,
            overrides=dict(self.overrides),
        )

    def _relaunch(self, attempt: int) -> None:
        """Resume the next launch from the newest complete checkpoint; the event names it, and the incomplete
        newer ones set aside."""
        self.overrides |= {"resume_from_checkpoint": "auto", "overwrite_output_dir": False}
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

    def _give_up_on_a_repeated_error(
        self, failure: Failure, previous: tuple[FailureKind, str] | None, attempt: int
    ) -> None:
        """End the run when a rank raised the error it raised the launch before: a retry would fail alike.

        :raises LaunchError: the error's message.
        """
        if failure.kind is FailureKind.APPLICATION_ERROR and previous == (failure.kind, failure.message):
            self._event("gave up", attempt, f"the same error twice, not retried again: {failure.message}")
            raise LaunchError(failure.message)

    def _give_up(self, code: int) -> int:
        """The run's end once the restarts are used up: the last launch's exit code.

        :rtype: int
        """
        if self.max_restarts:
            self._event("gave up", self.max_restarts, f"{self.max_restarts} restart(s) used up; exit code {code}")
        return code

    def _answers(self, host: str) -> bool:
        assert self.hosts is not None  # only recover() asks, and only of hosts it can replace
        return self.hosts.answers(host, timeout=SSH_CHECK_S)

    def _hostfile(self) -> dict[str, int]:
        if self.arguments.launcher != "pdsh":
            return {}
        return read_hostfile((self.arguments.hostfile or self.arguments.run_dir / HOSTFILE_NAME).resolve())

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
