"""Keep one training run going through lost workers: launch, watch, stop a stall, relaunch as recovery decides.

DeepSpeed's pdsh launcher ends the whole job on any failing rank, and its elastic mode does not work
with torch 2; so the process that owns the workers and the launch supervises it. :class:`Supervisor` runs
:func:`textsql.launching.launch.launch` with its output through a
:class:`textsql.launching.launch_watch.LaunchWatch`, which stops the launch on every host when no rank advances
for ``stall_timeout`` seconds; after a failed launch, :mod:`textsql.launching.recovery` says why it failed and
what to do (replace a lost worker, go on with fewer, relaunch from the newest complete checkpoint, give up).
The ranks' process-group timeout (``ddp_timeout``) is bounded too (:func:`process_group_timeout`), so a
collective gives up soon after the stall is seen rather than 30 minutes later.

Each event is one line on the launch's stream and a record in ``RUN_DIR/supervisor.json``, as it
happens: ``worker lost at step N (how), detected after T s`` (T: from the last step logged, or the
launch's start, to the first sign of the failure on the stream: an upper bound of how long it went
unnoticed), ``replacement for HOST registered`` (a hostfile's host: ``host HOST answers ssh again``),
``relaunching ... from checkpoint-M`` and, at the relaunch's first step, ``resumed from checkpoint-M``. A run
that finishes carries the same records in its ``run.json`` (key ``recovery``).

Usage::

    >>> with start_workers("local", 2, "runs/r1") as cluster:
    ...     supervise(LaunchArguments(run_dir=cluster.run_dir, train_args=[...]), cluster, max_restarts=3)
    0
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from textsql.arguments import train_argv
from textsql.console import TextSink
from textsql.constants import DEFAULT_MAX_RESTARTS, DEFAULT_REPLACE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, RUN_SUMMARY_NAME
from textsql.display.step_bar import shown_output
from textsql.errors import StoreError
from textsql.json_files import read_json, write_json
from textsql.launching.cluster_check import check_cluster
from textsql.launching.command import LaunchArguments
from textsql.launching.failures import Failure
from textsql.launching.launch import launch
from textsql.launching.launch_watch import LaunchWatch
from textsql.launching.recovery import Recovery, classify
from textsql.launching.stall import StallDetector
from textsql.launching.training_plan import TrainingPlan
from textsql.store.uploads import StoreUploads, store_uploads
from worker.cluster import Cluster

logger = logging.getLogger(__name__)

# The ranks' process-group timeout with the default stall timeout (torch's own is 30 minutes).
PROCESS_GROUP_TIMEOUT_S = 600


@dataclass
class Supervisor(Recovery):
    """Runs :func:`textsql.launching.launch.launch` until it succeeds, replacing lost workers, at most
    ``max_restarts`` times after the first launch (0: the first failure ends the run, as without it).

    The settings and the decisions after a failure are :class:`textsql.launching.recovery.Recovery`'s; with a
    checkpoint store, an upload that failed for good ends the launch and the run (:mod:`textsql.store.uploads`).
    """

    uploads: StoreUploads | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
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
            watch = self._watch(attempt, aware_at)
            if self.uploads is not None:
                self.uploads.ranks = self._world()
            try:
                code = launch(
                    self._launch_arguments(),
                    self.plan.with_overrides(self.overrides),
                    stream=watch,
                    should_stop=self._should_stop(watch),
                )
            finally:
                if self.hosts is not None:
                    self.hosts.relay_beats(None)
            if self.uploads is not None and self.uploads.failure is not None:
                raise StoreError(self.uploads.failure)
            if code == 0:
                if attempt:
                    self._event("finished", attempt, f"run finished after {attempt} restart(s)")
                self._record_in_summary(attempt)
                return 0
            failure = classify(code, watch, self.hosts.lost() if self.hosts is not None else {})
            aware_at = self._record_failure(failure, watch, attempt)
            self._give_up_on_a_repeated_error(failure, previous, attempt)
            if attempt == self.max_restarts:
                break
            self.recover(failure, attempt)
            previous = failure.kind, failure.message
            self._relaunch(attempt)
        return self._give_up(code)

    def _should_stop(self, watch: LaunchWatch) -> Callable[[], bool]:
        """The launch's stop condition: a stall, or an upload to the checkpoint store that failed for good."""
        uploads = self.uploads
        if uploads is None:
            return watch.stalled
        return lambda: watch.stalled() or uploads.failed()

    def _watch(self, attempt: int, aware_at: float | None) -> LaunchWatch:
        """The watch on a launch's output: its stall detector, which hears the hosts with an agent of ours from
        their agents (:mod:`worker.beats`), and for a relaunch, the resumed event."""
        resumed_from = self._checkpoint() if attempt else None
        detector = StallDetector(self.stall_timeout, hosts=self._hostfile())
        if self.hosts is not None:
            detector.relayed = self.hosts.relay_beats(detector.beat)
        return LaunchWatch(
            self.stream,
            list(self._hostfile()),
            on_first_step=self._on_relaunch_first_step(attempt, resumed_from, aware_at) if attempt else None,
            detector=detector,
        )

    def _record_failure(self, failure: Failure, watch: LaunchWatch, attempt: int) -> float:
        """The failure's event, with how long it went unnoticed; when this side knew of it.

        :rtype: float
        """
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
        return aware_at

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


def supervise(
    arguments: LaunchArguments,
    cluster: Cluster | None = None,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    stream: TextSink | None = None,
    min_workers: int | None = None,
    replace_timeout: float = DEFAULT_REPLACE_TIMEOUT_S,
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
    plan: TrainingPlan | None = None,
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
    :param plan: the launch's training arguments as :meth:`TrainingPlan.read` parsed them, when the caller checked
        them before starting its workers (notebook 02); None: parsed here, once.
    :rtype: int
    :raises TextSQLError: before anything is launched, for training arguments a rank would refuse.
    :raises ClusterError: before anything is launched, when the workers cannot train together.
    """
    plan = plan if plan is not None else TrainingPlan.read(arguments)
    arguments = replace(arguments, train_args=list(plan.rank_args))
    if cluster is not None:
        check_cluster(cluster.workers, arguments.run_dir, plan.model, arguments.socket_ifname)
    with contextlib.ExitStack() as stack:
        uploads = stack.enter_context(
            store_uploads(
                arguments.checkpoint_store,
                plan.output_dir,
                plan.save_total_limit,
                plan.resume_from_checkpoint,
                plan.overwrite_output_dir,
            )
        )
        output = stream if stream is not None else stack.enter_context(shown_output(run_dir=arguments.run_dir))
        code = Supervisor(
            arguments,
            cluster,
            max_restarts,
            replace_timeout=replace_timeout,
            min_workers=min_workers,
            stall_timeout=stall_timeout,
            stream=output,
            uploads=uploads,
            plan=plan,
        ).run()
        if code == 0 and uploads is not None:
            uploads.finish()
        return code


def process_group_timeout(stall_timeout: float | None) -> int:
    """The ranks' ``ddp_timeout`` under the supervisor: twice a given stall timeout (a collective that gave up
    first would read as a crash, and a rank's wait starts only after its last progress), else
    :data:`PROCESS_GROUP_TIMEOUT_S`, which still ends a default-timeout stall long before torch's 30 minutes.

    :rtype: int
    """
    return math.ceil(2 * stall_timeout) if stall_timeout is not None else PROCESS_GROUP_TIMEOUT_S
