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
MLflow starts (:func:`textsql.tracking.mlflow_runs.load_tracking_env`). The file lives as long as the launch:
it is written before the runner starts and removed when the launch ends, however it ends; one a hard kill left
behind is removed when the next launch starts (or its pipeline's leftovers are ended).

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
from pathlib import Path

from textsql.constants import TRACKING_ENV_NAME, TRACKING_ENV_VAR, TRACKING_PREFIX
from textsql.launching.command import LaunchArguments
from worker.files import atomic_write

logger = logging.getLogger(__name__)

# Both spellings `textsql train` accepts (train_argv writes the first).
OUTPUT_DIR_FLAGS = ("--run-dir", "--run_dir")


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
def tracking_env(arguments: LaunchArguments, environ: Mapping[str, str] | None = None) -> Iterator[LaunchArguments]:
    """``arguments`` whose ranks find ``environ``'s ``MLFLOW_*`` variables in a 0600 file, for one launch.

    With no such variable, or no ``--run-dir`` among the training arguments, ``arguments`` as they are.

    :param arguments: the launch.
    :param environ: the launching environment (``os.environ`` when None).
    :rtype: typing.Iterator[LaunchArguments]
    """
    variables = tracking_variables(os.environ if environ is None else environ)
    output_dir = _output_dir(arguments.train_args)
    if output_dir is not None:
        # One a hard-killed launch left behind, credentials in it: gone before anything else starts.
        (output_dir / TRACKING_ENV_NAME).unlink(missing_ok=True)
    if not variables or output_dir is None:
        yield arguments
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    path = atomic_write(output_dir / TRACKING_ENV_NAME, json.dumps(variables), mode=0o600).resolve()
    logger.info("MLflow settings %s reach the logging rank through %s", sorted(variables), path)
    try:
        yield dataclasses.replace(arguments, env=arguments.env | {TRACKING_ENV_VAR: str(path)})
    finally:
        path.unlink(missing_ok=True)


def _output_dir(train_args: list[str]) -> Path | None:
    """The ``--run-dir`` of a training command line (``--run-dir DIR`` or ``--run-dir=DIR``, or the same
    in snake_case): the last one given, as argparse takes it."""
    found = None
    for index, arg in enumerate(train_args):
        if arg in OUTPUT_DIR_FLAGS and index + 1 < len(train_args):
            found = Path(train_args[index + 1])
        elif arg.partition("=")[0] in OUTPUT_DIR_FLAGS:
            found = Path(arg.partition("=")[2])
    return found
