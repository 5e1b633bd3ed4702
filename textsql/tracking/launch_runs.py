"""Which MLflow run a launch's logging rank logs into, decided on the master and kept where the master keeps what it
trusts; and a run a hard kill left RUNNING, ended as KILLED.

A training is one MLflow run however many launches it takes. The master keeps the run's id in the run's
master-private directory (:func:`textsql.rundir.master_state.master_dir`, beside ``pipeline.json`` and ``launch_ids``), never
reading it back from the run directory the workers may write, and hands it to the logging rank as ``MLFLOW_RUN_ID``
with the other MLflow settings (:mod:`textsql.launching.tracking_env`). One rule decides the run:

- a launch whose training resumes (``--resume``: the supervisor's relaunch, with or without a checkpoint to resume
  from, and a pipeline's continuation of a training that did not complete) continues the run kept for its output
  directory, reopened if it was ended;
- any other launch, or one with no run kept for its output directory and tracking server, gets a new run.

So a run killed hard, marked KILLED when its pipeline continues (:func:`end_killed_run`), is reopened by the
continuation: its loss curve goes on from the checkpoint's step in the same run, as the resumed training does,
rather than splitting one training over two runs a reader has to join.

Usage::

    >>> run_id = launch_run(run_dir, output_dir, resumes=True, settings=tracking_variables(os.environ))
    >>> end_killed_run(run_dir)  # after the launch, and with a hard-killed run's leftovers
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from textsql.errors import DataError
from textsql.json_files import read_json, write_json
from textsql.rundir.master_state import master_dir
from textsql.sanitize import mask_credentials

logger = logging.getLogger(__name__)

# The MLflow run a run directory's launches log into, kept in its master-private directory.
MLFLOW_RUN_NAME = "mlflow_run.json"

RUNNING, KILLED = "RUNNING", "KILLED"


def launch_run(run_dir: Path, output_dir: Path, resumes: bool, settings: Mapping[str, str]) -> str | None:
    """The MLflow run the launch's logging rank logs into: the one kept for ``output_dir`` when the training
    resumes, else a new one (in ``MLFLOW_EXPERIMENT_NAME``, named after the output directory), kept.

    :param run_dir: the launch's run directory (its master-private directory keeps the run's id).
    :param output_dir: the training's output directory.
    :param resumes: whether the training resumes (``--resume`` given).
    :param settings: the launch's ``MLFLOW_*`` variables, ``MLFLOW_TRACKING_URI`` among them (the credentials are
        read from this process's environment, as MLflow does).
    :returns: the run's id; None when the tracking server cannot be reached from here (a warning: the
        logging rank then starts a run of its own).
    :rtype: str | None
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = settings["MLFLOW_TRACKING_URI"]
    kept = kept_run(run_dir)
    if resumes and kept.get("output_dir") == str(output_dir.resolve()) and kept.get("tracking_uri") == uri:
        return str(kept["run_id"])
    try:
        client = MlflowClient(uri)
        run = client.create_run(_experiment_id(client, settings), run_name=output_dir.name)
    except (MlflowException, OSError) as error:
        logger.warning("MLflow run not created here (%s): the logging rank starts its own", _first_line(error))
        return None
    record = {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": uri}
    write_json(master_dir(run_dir) / MLFLOW_RUN_NAME, record | {"output_dir": str(output_dir.resolve())})
    return str(run.info.run_id)


def kept_run(run_dir: Path) -> dict[str, Any]:
    """The MLflow run kept for the run directory (:func:`launch_run`), or an empty record.

    :rtype: dict
    """
    path = master_dir(run_dir) / MLFLOW_RUN_NAME
    try:
        record = read_json(path) if path.is_file() else {}
    except DataError as error:
        logger.warning("%s: no MLflow run kept", error)
        return {}
    return record if isinstance(record, dict) and "run_id" in record else {}


def end_killed_run(run_dir: Path, status: str = KILLED) -> bool:
    """Mark the MLflow run kept for ``run_dir`` ended (``status``) when it is still RUNNING though its launch is over:
    a hard kill, or ranks ended by the supervisor, leave it so. Tracking that fails here is a warning.

    :param run_dir: the launch's run directory.
    :param status: MLflow's status to set.
    :returns: whether the run was marked.
    :rtype: bool
    """
    kept = kept_run(run_dir)
    if not kept:
        return False
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        client = MlflowClient(kept["tracking_uri"])
        if client.get_run(kept["run_id"]).info.status != RUNNING:
            return False
        client.set_terminated(kept["run_id"], status)
    except (MlflowException, OSError) as error:
        logger.warning("MLflow run %s not marked %s: %s", kept["run_id"], status, _first_line(error))
        return False
    logger.warning("MLflow run %s was left RUNNING by a launch that is over: marked %s", kept["run_id"], status)
    return True


def _experiment_id(client: Any, settings: Mapping[str, str]) -> str:
    """``MLFLOW_EXPERIMENT_NAME``'s id (created when missing, as transformers' callback does), else
    ``MLFLOW_EXPERIMENT_ID``, else MLflow's default experiment."""
    name = settings.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return settings.get("MLFLOW_EXPERIMENT_ID", "0")
    experiment = client.get_experiment_by_name(name)
    return str(experiment.experiment_id) if experiment is not None else str(client.create_experiment(name))


def _first_line(error: Exception) -> str:
    return mask_credentials(str(error).splitlines()[0] if str(error) else type(error).__name__)
