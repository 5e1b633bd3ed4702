"""MLflow's variables for the rank that logs: in a 0600 file it reads, never on a command line.

DeepSpeed's runner exports every variable whose name starts with ``MLFLOW`` (its ``EXPORT_ENVS``) and every
``.deepspeed_env`` line as ``export KEY=VALUE`` on pdsh's remote command, which ``ps`` on the master and on
every host shows to every user, and which the runner logs as ``cmd = ...``. So the launching environment's
``MLFLOW_*`` variables (tracking URI, experiment, and credentials: ``MLFLOW_TRACKING_TOKEN``,
``MLFLOW_TRACKING_USERNAME``/``PASSWORD``) are kept from the runner and the ranks' environment altogether;
they are written, as JSON, to a file of mode 0600 in the training's output directory (the one directory
every backend's ranks reach: the shared volume on Kubernetes and CML, the hosts' own path for local and
static workers), and only the file's path reaches the ranks (:data:`~textsql.constants.TRACKING_ENV_VAR`
in ``.deepspeed_env``). The logging rank (world process zero) reads it into its own environment before
MLflow starts (:func:`textsql.tracking.mlflow_runs.load_tracking_env`). For a training that reports to MLflow on a
tracking server the master names, the file also holds ``MLFLOW_RUN_ID``, the run to log into, which the master
decides and keeps (:func:`textsql.tracking.launch_runs.launch_run`: a relaunch continues the training's run).
The output directory, whether the training resumes and where it reports come from the training's own parser
(:class:`~textsql.launching.training_plan.TrainingPlan`), so every spelling it accepts is understood here.

The file lives as long as the launch: it is written before the runner starts and removed when the launch ends,
however it ends; one a hard kill left behind is removed when the next launch starts (or its pipeline's leftovers
are ended). A run its ranks left RUNNING (ended by the supervisor, or by a signal) is marked KILLED when the launch
is over (a relaunch reopens it).

Usage::

    >>> with tracking_env(arguments) as arguments:
    ...     launch_ranks(arguments, runner_env=without_tracking(os.environ))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping

from textsql.constants import TRACKING_ENV_NAME, TRACKING_ENV_VAR, TRACKING_PREFIX
from textsql.launching.command import LaunchArguments
from textsql.launching.training_plan import TrainingPlan
from textsql.tracking.launch_runs import end_killed_run, launch_run
from textsql.tracking.mlflow_runs import RUN_ID_VAR, wants_mlflow
from worker.files import atomic_write

logger = logging.getLogger(__name__)

TRACKING_URI_VAR = "MLFLOW_TRACKING_URI"


def tracking_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``MLFLOW_*`` variables of ``environ``.

    :rtype: dict[str, str]
    """
    return {key: value for key, value in environ.items() if key.startswith(TRACKING_PREFIX)}


def without_tracking(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less its ``MLFLOW_*`` variables: the environment DeepSpeed's runner may see.

    :rtype: dict[str, str]
    """
    return {key: value for key, value in environ.items() if not key.startswith(TRACKING_PREFIX)}


@contextlib.contextmanager
def tracking_env(
    arguments: LaunchArguments, plan: TrainingPlan, environ: Mapping[str, str] | None = None
) -> Iterator[LaunchArguments]:
    """``arguments`` whose ranks find ``environ``'s ``MLFLOW_*`` variables in a 0600 file, for one launch.

    With no such variable, or no run directory among the training arguments, ``arguments`` as they are.

    :param arguments: the launch.
    :param plan: its training arguments, parsed (:meth:`TrainingPlan.read`, with a relaunch's overrides).
    :param environ: the launching environment (``os.environ`` when None).
    :rtype: typing.Iterator[LaunchArguments]
    """
    variables = tracking_variables(os.environ if environ is None else environ)
    output_dir = plan.output_dir
    if output_dir is not None:
        # One a hard-killed launch left behind, credentials in it: gone before anything else starts.
        (output_dir / TRACKING_ENV_NAME).unlink(missing_ok=True)
    if not variables or output_dir is None:
        yield arguments
        return
    run_id = None
    if wants_mlflow(plan.report_to) and TRACKING_URI_VAR in variables and RUN_ID_VAR not in variables:
        run_id = launch_run(arguments.run_dir, output_dir, plan.resume_from_checkpoint is not None, variables)
    variables |= {RUN_ID_VAR: run_id} if run_id else {}
    output_dir.mkdir(parents=True, exist_ok=True)
    path = atomic_write(output_dir / TRACKING_ENV_NAME, json.dumps(variables), mode=0o600).resolve()
    logger.info("MLflow settings %s reach the logging rank through %s", sorted(variables), path)
    try:
        yield dataclasses.replace(arguments, env=arguments.env | {TRACKING_ENV_VAR: str(path)})
    finally:
        path.unlink(missing_ok=True)
        if run_id:
            end_killed_run(arguments.run_dir)
