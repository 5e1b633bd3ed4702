"""The record of a pipeline of notebooks (``pipeline.json``, in the run's master-private directory), and what a
continuation runs.

Every run of the notebooks in order (``textsql demo``, the AMP's job chain) writes, for each notebook, the
parameters it ran with, whether it completed, the outputs it left and which run of the notebooks before it
it read. When the pipeline continues (``textsql demo --resume``, the AMP's jobs: :func:`continuation_steps`) a
notebook that completed with the same parameters, whose outputs are all still there and whose inputs did not run
again since is skipped; a training notebook that did not complete is relaunched, its training resumed from its
newest complete checkpoint; the rest run, and so does every notebook after one that runs.

A change that would make a checkpoint train on something else (another dataset, model, profile, batch or
learning rate under it) is refused in one line, since the trainer would either fail or silently keep the
checkpoint's values. What training's parameters resolved to is recorded when it starts
(:func:`~textsql.pipeline.parameters.resolved_training`)
and compared, not the parameters alone: the profile ``auto`` picks for the workers, and the number of ranks, which a
ZeRO-1/2/3 checkpoint without a universal conversion cannot change (:mod:`textsql.rundir.universal`).

The file is replaced whole at every change (:func:`textsql.json_files.write_json`: a temp file beside it, fsync,
rename), so a run killed at any moment leaves the previous record or the new one, never half of one.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from textsql.constants import (
    METRICS_NAME,
    MODEL_SUBDIR,
    PREDICTIONS_NAME,
    PREPARE_JSON_NAME,
    REAL_METRICS_NAME,
    REAL_PREDICTIONS_NAME,
    RUN_SUMMARY_NAME,
)
from textsql.data.tables import DATASET_DICT_FILE
from textsql.json_files import read_json, write_json
from textsql.pipeline.parameters import NOTEBOOKS, NOTEBOOKS_DIR, NotebookError, declared_defaults, resolved_training
from textsql.rank_lines import RUN_MARK_VAR, run_mark
from textsql.rundir.checkpoints import newest_complete_checkpoint
from textsql.rundir.master_state import master_dir
from textsql.rundir.universal import needs_conversion

logger = logging.getLogger(__name__)

MANIFEST_NAME = "pipeline.json"
MANIFEST_VERSION = 1
# Every process of one attempt (the notebooks' kernels, their workers, sshd, DeepSpeed's runner) carries
# this variable with the attempt's id, so a continuation can find what a hard kill of the attempt left behind.
ATTEMPT_VAR = "TEXTSQL_PIPELINE_ATTEMPT"
PREPARE, TRAIN, INFER = NOTEBOOKS
RUNNING, COMPLETED, FAILED = "running", "completed", "failed"
# Parameters that say how a notebook runs, not what it produces: a change re-runs nothing.
CONTROL_PARAMETERS = {
    PREPARE: {"log_level", "num_proc", "overwrite"},
    TRAIN: {
        "log_level",
        "resume_from_checkpoint",
        "overwrite_output_dir",
        "checkpoint_store",
        "max_restarts",
        "min_workers",
        "replace_timeout",
        "stall_timeout",
    },
    INFER: {"log_level"},
}
# Parameters a checkpoint was trained under: changed, training cannot resume from the checkpoint (the trainer would
# fail to load it, or keep the checkpoint's own value without a word).
PINNED_PARAMETERS: dict[str, tuple[str, ...]] = {
    PREPARE: ("source", "input_format", "model", "data_dir", "limit"),
    TRAIN: ("model", "data_dir", "profile", "per_device_train_batch_size", "learning_rate", "seed"),
}
# What a notebook needs to replace what an earlier run of it left: 01 refuses an existing data_dir, 02 a run_dir
# with checkpoints, unless told.
FRESH_PARAMETERS: dict[str, dict[str, Any]] = {
    PREPARE: {"overwrite": True},
    TRAIN: {"resume_from_checkpoint": None, "overwrite_output_dir": True},
    INFER: {},
}


@dataclass(frozen=True)
class Step:
    """What a continuation does with one notebook: ``skip``, ``relaunch`` (the training notebook again, its training
    resumed from a checkpoint) or ``run`` (from the start), why, and the parameters it adds to the chosen ones
    (``resume_from_checkpoint``, ``overwrite_output_dir``, ``overwrite``)."""

    action: str
    reason: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        return self.action != "skip"


def manifest_path(run_dir: str | Path) -> Path:
    """Where the pipeline's record lives: the run's master-private directory, since a continuation trusts it (which
    notebooks to skip, which attempt's processes to end), and workers may write the run directory.

    :param run_dir: the run directory (the demo's ``--run-dir``, notebook 02's ``run_dir``).
    :rtype: pathlib.Path
    """
    return master_dir(run_dir) / MANIFEST_NAME


def chain_run_dir(chosen: Mapping[str, Mapping[str, Any]]) -> Path:
    """The run directory of a chain of notebooks: notebook 02's ``run_dir``, as its kernel (in ``notebooks/``) sees it.

    :param chosen: every notebook's parameters.
    :rtype: pathlib.Path
    """
    return notebook_relative(chosen[TRAIN]["run_dir"])


def notebook_relative(path: str | Path) -> Path:
    """A notebook's path parameter as an absolute path (a relative one is relative to ``notebooks/``)."""
    return (NOTEBOOKS_DIR / Path(path).expanduser()).resolve()


def effective_parameters(name: str, chosen: Mapping[str, Any]) -> dict[str, Any]:
    """The notebook's declared defaults with ``chosen`` over them: what its run really used.

    :rtype: dict
    """
    return {**declared_defaults(name), **chosen}


def outputs(name: str, parameters: Mapping[str, Any]) -> list[Path]:
    """The files a completed run of the notebook leaves, which must all still be there for it to be skipped.

    :param name: the notebook.
    :param parameters: its effective parameters.
    :rtype: list[pathlib.Path]
    """
    if name == PREPARE:
        data = notebook_relative(parameters["data_dir"])
        return [data / DATASET_DICT_FILE, data / PREPARE_JSON_NAME]
    run = notebook_relative(parameters["run_dir"])
    if name == TRAIN:
        return [run / MODEL_SUBDIR / "config.json", run / RUN_SUMMARY_NAME]
    real = [run / REAL_PREDICTIONS_NAME, run / REAL_METRICS_NAME] if parameters.get("real_source") else []
    return [run / PREDICTIONS_NAME, run / METRICS_NAME, *real]


class Manifest:
    """The pipeline's record: read from and written to ``run_dir/pipeline.json`` at every change.

    Usage::

        manifest = Manifest.load(run_dir)
        manifest.begin()                          # a new attempt; manifest.marks() go to what it starts
        manifest.started("01_prepare_dataset", parameters, executed_copy)
        manifest.finished("01_prepare_dataset", completed=True)
    """

    def __init__(self, run_dir: str | Path, data: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.data: dict[str, Any] = data or {"version": MANIFEST_VERSION, "attempt": {}, "notebooks": {}}

    @classmethod
    def load(cls, run_dir: str | Path) -> Manifest:
        """The record in ``run_dir``, or an empty one when there is none.

        :rtype: Manifest
        :raises DataError: naming the file, when it is not JSON.
        """
        path = manifest_path(run_dir)
        data = read_json(path) if path.is_file() else None
        if data is not None and data.get("version") != MANIFEST_VERSION:
            raise NotebookError(
                f"{path} is of version {data.get('version')!r}, not {MANIFEST_VERSION}; run without --resume to start over"
            )
        return cls(run_dir, data)

    @property
    def records(self) -> dict[str, dict[str, Any]]:
        return self.data["notebooks"]

    @property
    def attempt(self) -> dict[str, Any]:
        return self.data["attempt"]

    def save(self) -> None:
        write_json(manifest_path(self.run_dir), self.data)

    def running_elsewhere(self) -> int | None:
        """The pid of the attempt that wrote this record when it is still running (the same process, not a
        later one given its pid), else None.

        :rtype: int | None
        """
        pid, created = self.attempt.get("pid"), self.attempt.get("created")
        if not pid or pid == os.getpid():
            return None
        try:
            return pid if psutil.Process(pid).create_time() == created else None
        except psutil.NoSuchProcess:
            return None

    def begin(self) -> str:
        """Start an attempt: a new id, recorded with this process. This process's environment is left as it is: the
        notebooks' kernels get the attempt's marks from :meth:`marks`, and every worker and launcher they start
        inherits them.

        :rtype: str
        :returns: the attempt's id.
        """
        attempt = secrets.token_hex(8)
        self.data["attempt"] = {
            "id": attempt,
            "pid": os.getpid(),
            "created": psutil.Process().create_time(),
            "started": time.time(),
        }
        self.save()
        return attempt

    def marks(self) -> dict[str, str]:
        """The variables every process of the attempt carries: its id and the run's mark, by which a continuation
        finds what a hard kill of it left (:mod:`textsql.pipeline.leftovers`).

        :rtype: dict[str, str]
        """
        return {ATTEMPT_VAR: self.attempt["id"], RUN_MARK_VAR: run_mark(self.run_dir)}

    def started(self, name: str, parameters: Mapping[str, Any], executed: Path) -> None:
        """Record that ``name`` runs now with these (effective) parameters, after the runs of the notebooks before it,
        and for training what they resolve to (:func:`~textsql.pipeline.parameters.resolved_training`).

        :param name: the notebook.
        :param parameters: its effective parameters (:func:`effective_parameters`).
        :param executed: where papermill writes its executed copy.
        """
        before = NOTEBOOKS[: NOTEBOOKS.index(name)]
        self.records[name] = {
            "run": secrets.token_hex(8),
            "status": RUNNING,
            "parameters": dict(parameters),
            "inputs": {other: self.records[other]["run"] for other in before if other in self.records},
            "executed": str(executed),
            "started": time.time(),
            "outputs": [],
        }
        if name == TRAIN:
            self.records[name]["resolved"] = resolved_training(parameters)
        self.save()

    def finished(self, name: str, completed: bool) -> None:
        """Record how ``name`` ended and, when it completed, the outputs it left.

        :param name: the notebook.
        :param completed: whether every cell ran.
        """
        record = self.records[name]
        record["status"] = COMPLETED if completed else FAILED
        record["finished"] = time.time()
        if completed:
            found = [path for path in outputs(name, record["parameters"]) if path.exists()]
            record["outputs"] = [str(path) for path in [*found, Path(record["executed"])]]
        self.save()


def changed_parameters(name: str, recorded: Mapping[str, Any], parameters: Mapping[str, Any]) -> dict[str, tuple]:
    """The parameters of ``name`` that differ from the recorded run's, control parameters aside: name -> (old, new).

    :rtype: dict
    """
    names = (set(recorded) | set(parameters)) - CONTROL_PARAMETERS[name]
    return {
        key: (recorded.get(key), parameters.get(key))
        for key in sorted(names)
        if recorded.get(key) != parameters.get(key)
    }


def _why_it_runs(manifest: Manifest, name: str, parameters: Mapping[str, Any], upstream_runs: list[str]) -> str | None:
    """Why ``name`` must run (None: it completed as asked and may be skipped)."""
    record = manifest.records.get(name)
    if record is None:
        return "no record of an earlier run"
    if upstream_runs:
        return f"{upstream_runs[-1]} runs again"
    if record["status"] != COMPLETED:
        return f"it did not complete ({record['status']})"
    changed = changed_parameters(name, record["parameters"], parameters)
    if changed:
        return "changed " + ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
    gone = next((path for path in record["outputs"] if not Path(path).exists()), None)
    if gone is not None:
        return f"its output {gone} is gone"
    for other in NOTEBOOKS[: NOTEBOOKS.index(name)]:
        if other in manifest.records and record["inputs"].get(other) != manifest.records[other]["run"]:
            return f"{other} ran again since"
    return None


def _pinned_changes(manifest: Manifest, chosen: Mapping[str, Mapping[str, Any]], checkpoint: Path) -> list[str]:
    changes = []
    for name, pinned in PINNED_PARAMETERS.items():
        record = manifest.records.get(name)
        if record is None:
            continue
        if "resolved" in record:  # the profile it resolved to is compared instead (older records lack it)
            pinned = tuple(key for key in pinned if key != "profile")
        changed = changed_parameters(name, record["parameters"], effective_parameters(name, chosen[name]))
        changes += [f"{key} ({old!r} -> {new!r})" for key, (old, new) in changed.items() if key in pinned]
    record = manifest.records[TRAIN]
    # Another model or profile is refused already, and resolving it could need its config from the network.
    if "resolved" in record and not changes:
        old, new = record["resolved"], resolved_training(effective_parameters(TRAIN, chosen[TRAIN]))
        for key in ("profile", "precision"):
            if key in old and old[key] != new[key]:  # records from before the precision lack it
                changes.append(f"the {key} it resolved to ({old[key]!r} -> {new[key]!r})")
        if old["ranks"] != new["ranks"] and needs_conversion(checkpoint, new["ranks"]):
            changes.append(f"its ranks, workers x worker_gpus ({old['ranks']} -> {new['ranks']})")
    return changes


def continuation_steps(manifest: Manifest, chosen: Mapping[str, Mapping[str, Any]]) -> dict[str, Step]:
    """What a continuation of the pipeline does with each notebook, in order.

    :param manifest: the pipeline's record.
    :param chosen: every notebook's parameters now (the demo's or the job's; defaults filled in here).
    :rtype: dict[str, Step]
    :raises NotebookError: one line naming a changed parameter a checkpoint was trained under, and the fix.
    """
    steps: dict[str, Step] = {}
    upstream_runs: list[str] = []
    for name in NOTEBOOKS:
        parameters = effective_parameters(name, chosen[name])
        reason = _why_it_runs(manifest, name, parameters, upstream_runs)
        if reason is None:
            steps[name] = Step("skip", "completed with the same parameters; its outputs are in place")
            continue
        upstream_runs.append(name)
        steps[name] = Step("run", reason, FRESH_PARAMETERS[name])
        if name == TRAIN:
            steps[name] = _training_step(manifest, chosen, parameters, reason, data_again=len(upstream_runs) > 1)
    return steps


def _training_step(
    manifest: Manifest,
    chosen: Mapping[str, Mapping[str, Any]],
    parameters: Mapping[str, Any],
    reason: str,
    data_again: bool,
) -> Step:
    record = manifest.records.get(TRAIN)
    checkpoint = newest_complete_checkpoint(notebook_relative(parameters["run_dir"]))
    relaunch = {"resume_from_checkpoint": "auto", "overwrite_output_dir": False}
    from_store = "resuming from the newest complete checkpoint in its checkpoint store, else from step 0"
    if (
        record is None
        and checkpoint is None
        and parameters.get("checkpoint_store")
        and not parameters["overwrite_output_dir"]
    ):
        # The run directory is lost (a new pod, volume or project): the store holds what is left of the training,
        # which a fresh run (overwrite_output_dir) would delete.
        return Step("relaunch", f"{reason}: {from_store}", relaunch)
    if record is None or record["status"] == COMPLETED or parameters["overwrite_output_dir"]:
        return Step("run", reason, FRESH_PARAMETERS[TRAIN])
    if checkpoint is None:
        # The same training starts over from step 0, in the same MLflow run (textsql.tracking.launch_runs), unless
        # it is another training now: its dataset prepared again, or a parameter of its changed.
        prepared_since = record["inputs"].get(PREPARE) != manifest.records.get(PREPARE, {}).get("run")
        if data_again or prepared_since or changed_parameters(TRAIN, record["parameters"], parameters):
            return Step("run", reason, FRESH_PARAMETERS[TRAIN])
        restart = from_store if parameters.get("checkpoint_store") else "starting again from step 0"
        return Step("relaunch", f"{reason}: no complete checkpoint here, {restart}", relaunch)
    changes = _pinned_changes(manifest, chosen, Path(checkpoint))
    if changes:
        raise NotebookError(
            f"cannot resume {TRAIN} from {Path(checkpoint).name}, which was trained before {', '.join(changes)} changed; "
            f"set {'them' if len(changes) > 1 else 'it'} back to resume, or overwrite_output_dir=true to train from step 0"
        )
    return Step("relaunch", f"{reason}: resuming from {Path(checkpoint).name}", relaunch)
