"""One MLflow run per training, logged by the world's process zero (``--report_to mlflow``).

transformers' ``MLflowCallback`` (``integrations/integration_utils.py``) does the per-step work on world process
zero only: it logs every ``Trainer.log`` entry as metrics (the train loss each ``logging_steps``, each
evaluation's loss, logical-form, parse-rate and execution accuracy, the final evaluation's too). What it
does not do, this module does around it:

- the MLflow settings reach the logging rank from a 0600 file, not a command line
  (:func:`load_tracking_env`; :mod:`textsql.launching.tracking_env` writes it);
- the run is started here, before the trainer's callback sets up: the callback then logs into it and
  leaves it open (it ends only runs it started), and its dump of every training argument and the model
  config (hundreds of parameters) is switched off with its own ``MLFLOW_MAX_LOG_PARAMS=0``; the parameters a
  person compares runs by are logged instead (:func:`run_params`);
- a relaunch continues the same MLflow run, so a training is one run, however many launches it took: a launch
  hands the logging rank the run to log into as ``MLFLOW_RUN_ID`` (:mod:`textsql.tracking.launch_runs` decides it
  on the master); ``textsql train`` on its own, resuming from a checkpoint, continues the run recorded in its output
  directory. The parameters are logged once, on the run's first launch;
- at the end, ``run.json``, the trainer's metrics and the model card are logged as artifacts and the run ends;
  a rank that dies with an exception marks it FAILED. Inference's ``metrics.json`` is not among them: a training
  writes none, so one there is an earlier model's (``--overwrite-output-dir`` keeps it); scoring this model adds
  its own (:func:`log_evaluation`).

Usage::

    >>> load_tracking_env()
    >>> start_tracking(trainer, run_params(model_args, data_args, run_args, trainer.args), resumed=False)
    >>> trainer.train()
    >>> finish_tracking(trainer)
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textsql.arguments import DataArguments, ModelArguments, RunArguments, output_path
from textsql.constants import (
    METRICS_NAME,
    MODEL_SUBDIR,
    PREPARE_JSON_NAME,
    RUN_SUMMARY_NAME,
    TRACKING_ENV_VAR,
    TRACKING_PREFIX,
)
from textsql.errors import DataError, LaunchError
from textsql.json_files import read_json, write_json
from textsql.sanitize import mask_credentials
from textsql.tracking.launch_runs import MLFLOW_RUN_NAME, kept_run
from worker.files import UnsafeRead, read_bounded

if TYPE_CHECKING:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

logger = logging.getLogger(__name__)
# What MLflow names a run: 32 hex digits (a uuid4's).
RUN_ID = re.compile(r"[0-9a-f]{32}")

# The run a launch hands the logging rank (textsql.tracking.launch_runs); MLflow's own variable.
RUN_ID_VAR = "MLFLOW_RUN_ID"
# The launch's MLflow variables take a few hundred bytes; a larger file is no file the launch wrote.
MAX_TRACKING_FILE_BYTES = 64 * 1024

MLFLOW = "mlflow"
# The trainer writes these at its end (Trainer.save_metrics): train and final evaluation metrics.
TRAINER_METRICS_NAME = "all_results.json"
MODEL_CARD = Path(MODEL_SUBDIR) / "README.md"


def wants_mlflow(report_to: str | list[str] | None) -> bool:
    """Whether ``--report_to`` asks for MLflow (``mlflow``, a list holding it, or ``all`` with mlflow installed).

    :rtype: bool
    """
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return MLFLOW in names or ("all" in names and importlib.util.find_spec(MLFLOW) is not None)


def check_tracking(report_to: str | list[str] | None) -> None:
    """Refuse ``--report_to mlflow`` where the ``mlflow`` package is missing, before anything starts.

    :raises LaunchError: naming the install and the alternative.
    """
    if wants_mlflow(report_to) and importlib.util.find_spec(MLFLOW) is None:
        raise LaunchError(
            "--report_to mlflow needs the mlflow package on every host; pip install 'textsql[tracking]' "
            "(or pass --report_to tensorboard)"
        )


def load_tracking_env(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Put the ``MLFLOW_*`` variables of the launch's 0600 file into this process's environment.

    A variable the rank's own environment already has (the host's, e.g. a CML project's) is kept.

    :param environ: the environment to fill (``os.environ`` when None).
    :returns: the names set.
    :rtype: list[str]
    """
    environ = os.environ if environ is None else environ
    path = environ.get(TRACKING_ENV_VAR)
    if not path:
        return []
    try:
        variables = json.loads(read_bounded(Path(path), MAX_TRACKING_FILE_BYTES))
        if not isinstance(variables, dict):
            raise TypeError(f"a JSON {type(variables).__name__}, not an object")
    except (OSError, UnsafeRead, ValueError, TypeError) as error:
        # Another uid's 0600 file (master and pods run as different users), a host that cannot see the directory,
        # a damaged file: the rank trains on, logging with its host's own settings.
        logger.warning(
            "%s names %s, which this host cannot read (%s): MLflow uses this host's own settings",
            TRACKING_ENV_VAR,
            path,
            error,
        )
        return []
    # Only MLflow's own variables: the file lies in the output directory, and a swapped one must not set LD_PRELOAD.
    loaded = [key for key in variables if key.startswith(TRACKING_PREFIX) and key not in environ]
    environ.update({key: str(variables[key]) for key in loaded})
    return loaded


def run_params(
    model_args: ModelArguments, data_args: DataArguments, run_args: RunArguments, args: Seq2SeqTrainingArguments
) -> dict[str, Any]:
    """The parameters a person compares trainings by (model, profile, precision, recipe, world size, batch
    or token budget, data source); those that are unset are left out.

    :rtype: dict[str, typing.Any]
    """
    prepared = Path(data_args.prepared_dir()) / PREPARE_JSON_NAME
    record = read_json(prepared) if prepared.is_file() else {}
    params = {
        "model": model_args.model,
        "profile": run_args.profile,
        "precision": model_args.precision,
        "recipe": getattr(run_args, "recipe", None),
        "world_size": args.world_size,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_tokens_per_batch": data_args.max_tokens_per_batch,
        "learning_rate": args.learning_rate,
        "lr_scheduler_type": str(args.lr_scheduler_type),
        "max_steps": args.max_steps,
        "seed": args.seed,
        "loss_vocabulary": model_args.loss_vocabulary,
        "data_source": record.get("source"),
        "input_format": record.get("input_format"),
        "data_dir": data_args.data_dir,
    }
    return {name: value for name, value in params.items() if value is not None}


def start_tracking(trainer: Seq2SeqTrainer, params: Mapping[str, Any], resumed: bool) -> str | None:
    """Start (or, resuming, continue) the training's MLflow run on world process zero, before ``trainer.train()``.

    :param trainer: the trainer, its ``MLflowCallback`` not yet set up.
    :param params: logged on a new run (:func:`run_params`).
    :param resumed: whether training resumes from a checkpoint: the recorded run is continued.
    :returns: the MLflow run id on the logging rank, None elsewhere or without ``--report_to mlflow``.
    :rtype: str | None
    """
    if not (wants_mlflow(trainer.args.report_to) and trainer.is_world_process_zero()):
        return None
    load_tracking_env()
    import mlflow

    # The callback's own parameter dump (every training argument and the model config) is off: see run_params.
    os.environ.setdefault("MLFLOW_MAX_LOG_PARAMS", "0")
    record = output_path(trainer.args) / MLFLOW_RUN_NAME
    # The launch's choice (textsql.tracking.launch_runs), taken out of the environment: transformers' callback starts
    # a run of its own whenever MLFLOW_RUN_ID is set, and must join this one instead.
    run_id = os.environ.pop(RUN_ID_VAR, None)
    if run_id is None and resumed and record.is_file():  # `textsql train` on its own, resuming
        run_id = read_json(record).get("run_id")
    if run_id is None and os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        # Created when missing, as the callback does.
        mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
    run = mlflow.start_run(run_id=run_id, run_name=None if run_id else output_path(trainer.args).name)
    continued = bool(run.data.params)
    if not continued:
        mlflow.log_params(dict(params))
    write_json(record, {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id})
    # Registered after mlflow's own exit hook, so it runs first: a rank ending by an exception fails the run.
    atexit.register(_end_unfinished, mlflow)
    logger.warning(
        "MLflow run %s (experiment %s)%s", run.info.run_id, run.info.experiment_id, " continued" if continued else ""
    )
    return str(run.info.run_id)


def finish_tracking(trainer: Seq2SeqTrainer) -> None:
    """Log the run's record files as artifacts and end the MLflow run (world process zero; a no-op elsewhere).

    :param trainer: the trainer whose output directory holds ``run.json``, the trainer's metrics and ``model/``.
    """
    if not (wants_mlflow(trainer.args.report_to) and trainer.is_world_process_zero()):
        return
    import mlflow

    if mlflow.active_run() is None:
        return
    output = output_path(trainer.args)
    for path in (output / RUN_SUMMARY_NAME, output / TRAINER_METRICS_NAME):
        if path.is_file():
            mlflow.log_artifact(str(path))
    if (output / MODEL_CARD).is_file():
        mlflow.log_artifact(str(output / MODEL_CARD), artifact_path=MODEL_CARD.parent.name)
    mlflow.end_run()


def log_evaluation(run_dir: Path, split: str, metrics: Mapping[str, Any], metrics_file: Path) -> bool:
    """Add an inference's scores (``metrics.json``) to the MLflow run of the training in ``run_dir``, if it had one.

    The scores are logged as ``<split>_lf_accuracy`` and so on (those of another file than ``metrics.json``,
    notebook 03's ``real_metrics.json``, as ``real_<split>_lf_accuracy``), the file as an artifact under
    ``<split>/``. Tracking that fails (no server, no credentials here) is a warning: the predictions and
    ``metrics.json`` are already written.

    :param run_dir: the training's output directory (where ``mlflow_run.json`` is).
    :param split: the split scored.
    :param metrics: the scores (:func:`textsql.scoring.evaluate.evaluate`); numbers are logged.
    :param metrics_file: the ``metrics.json`` written.
    :returns: whether they were logged.
    :rtype: bool
    """
    run_id = evaluated_run(run_dir)
    if run_id is None or importlib.util.find_spec(MLFLOW) is None:
        return False
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    source = metrics_file.stem.removesuffix(Path(METRICS_NAME).stem).rstrip("_")
    prefix = f"{source}_{split}" if source else split
    scores = {f"{prefix}_{name}": value for name, value in metrics.items() if isinstance(value, int | float)}
    try:
        client = MlflowClient()
        for name, value in scores.items():
            client.log_metric(run_id, name, float(value))
        client.log_artifact(run_id, str(metrics_file), artifact_path=split)
    except (MlflowException, OSError) as error:
        logger.warning(
            "the scores were not logged to MLflow run %s: %s", run_id, mask_credentials(str(error).splitlines()[0])
        )
        return False
    return True


def evaluated_run(run_dir: Path) -> str | None:
    """The MLflow run of the training in ``run_dir``: the one its launch kept on the master
    (:func:`textsql.tracking.launch_runs.kept_run`, which no worker can write), else, for a ``textsql train`` run
    without a launch, the id its logging rank wrote into the run directory, if it is an MLflow run id at all.

    :rtype: str | None
    """
    kept = kept_run(run_dir)
    if kept.get("output_dir") == str(run_dir.resolve()):
        return str(kept["run_id"])
    record = run_dir / MLFLOW_RUN_NAME
    if not record.is_file():
        return None
    try:
        recorded = read_json(record)
    except DataError:  # a link, an oversized file, not JSON: said below like any record holding no run id
        recorded = None
    run_id = recorded.get("run_id") if isinstance(recorded, dict) else None
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        logger.warning("%s holds no MLflow run id: the scores are not logged to MLflow", record)
        return None
    return run_id


def _end_unfinished(mlflow: Any) -> None:
    if mlflow.active_run() is not None:
        mlflow.end_run(status="FAILED")
