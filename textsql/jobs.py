"""Run the project's notebooks headless with papermill: all three on the embedded default (``make demo``),
or one at a time as a scheduled job does.

The notebooks stay the single place the workflow is written down; this module only chooses their
parameters, runs them in order, and reports where the time went. A notebook that fails stops the run
with one line naming the cell's error and the executed copy to open.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from textsql.console import is_verbose, log_level
from textsql.constants import (
    LAUNCH_LOG_NAME,
    METRICS_NAME,
    PREDICTIONS_NAME,
    PREPARE_JSON_NAME,
    PROJECT_DIR,
    REAL_METRICS_NAME,
    RUN_SUMMARY_NAME,
)
from textsql.display.terminal import StageView, cell_output_to
from textsql.errors import TextSQLError
from textsql.files import read_json
from textsql.training.profiles import AUTO_PROFILE, get_profile
from worker.constants import HOSTFILE_NAME

logger = logging.getLogger(__name__)

NOTEBOOKS_DIR = PROJECT_DIR / "notebooks"
NOTEBOOKS = ("01_prepare_dataset", "02_train_distributed", "03_inference")
KERNEL_NAME = "python3"
# The kernel's own log is no concern of a user's: a start-up warning (TCP on loopback, which papermill
# chose), and an ERROR line when the interrupt jupyter_client sends at every shutdown lands while the kernel
# is still handling a message (a race, seen under load). A cell's error reaches the user through papermill.
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL"]
# Any notebook parameter can be set from the environment as TEXTSQL_<PARAMETER> (CML job and project
# variables, the AMP's defaults); values are read as YAML so numbers and booleans keep their type.
ENV_PREFIX = "TEXTSQL_"
# Parameters that name a path, and those that name a path or something else (a hub id, "sample"). Set in the
# environment (a CML job, the AMP) a relative one is relative to the project root, where CML runs jobs and
# where users think; the kernel itself runs in notebooks/ as in JupyterLab.
PATH_PARAMETERS = ("data_dir", "run_dir", "model_dir")
PATH_OR_NAME_PARAMETERS = ("model", "source")
# Marks a directory as the demo's own, so a second `make demo` may replace it (and nothing else).
DEMO_MARKER = ".textsql-demo"
# The cells' output of a demo at the default log level (the executed notebooks hold it too).
DEMO_LOG_NAME = "demo.log"
# Notebooks whose first cell sets the run's log level from their `log_level` parameter.
LOG_LEVEL_NOTEBOOKS = ("01_prepare_dataset", "02_train_distributed", "03_inference")


class NotebookError(TextSQLError):
    """A notebook run by papermill failed; the executed copy shows the failing cell."""


@dataclass
class DemoResult:
    """What ``make demo`` produced, and how long each notebook took."""

    out_dir: Path
    seconds: dict[str, float] = field(default_factory=dict)
    notebooks: dict[str, Path] = field(default_factory=dict)


def notebook_path(name: str) -> Path:
    """The committed notebook called ``name`` (with or without ``.ipynb``).

    :param name: ``01_prepare_dataset``, ``02_train_distributed`` or ``03_inference``.
    :rtype: pathlib.Path
    """
    stem = name.removesuffix(".ipynb")
    if stem not in NOTEBOOKS:
        raise NotebookError(f"unknown notebook {name!r}; pass one of {', '.join(NOTEBOOKS)}")
    return NOTEBOOKS_DIR / f"{stem}.ipynb"


def declared_parameters(name: str) -> dict[str, dict[str, Any]]:
    """The notebook's parameters as papermill reads them: name, type, default (source text) and help.

    Read from the cell tagged ``parameters`` here rather than by ``papermill.inspect_notebook``, whose import
    (nbformat's schema validation, over 2 s) would come before a mistyped ``-p`` could be refused;
    ``tests/test_jobs.py`` holds the two readers to the same answer for every notebook.

    :param name: the notebook.
    :rtype: dict
    """
    cell = next(
        (cell for cell in read_json(notebook_path(name))["cells"] if "parameters" in cell["metadata"].get("tags", ())),
        None,
    )
    if cell is None:
        raise NotebookError(f"notebook {name} has no cell tagged 'parameters'; tag the cell that sets its parameters")
    source = "".join(cell["source"])
    lines = source.splitlines()
    declared = {}
    for statement in ast.parse(source).body:
        if not isinstance(statement, ast.AnnAssign | ast.Assign):
            continue
        target = statement.target if isinstance(statement, ast.AnnAssign) else statement.targets[0]
        if not isinstance(target, ast.Name) or statement.value is None:
            continue
        annotation = getattr(statement, "annotation", None)
        # The help is the comment after the value, on the statement's last line, as papermill reads it.
        _, _, comment = lines[(statement.end_lineno or statement.lineno) - 1][statement.end_col_offset :].partition("#")
        declared[target.id] = {
            "name": target.id,
            "inferred_type_name": ast.get_source_segment(source, annotation) if annotation else "None",
            "default": ast.get_source_segment(source, statement.value),
            "help": comment.strip(),
        }
    return declared


def parameters_from_environ(
    name: str, environ: Mapping[str, str] | None = None, root: Path = PROJECT_DIR
) -> dict[str, Any]:
    """The notebook's parameters that are set as ``TEXTSQL_<NAME>`` in the environment; relative paths
    among them are made absolute against the project root (:func:`project_path`).

    :param name: the notebook.
    :param environ: the environment to read (``os.environ`` when None).
    :param root: the project root.
    :rtype: dict
    """
    environ = os.environ if environ is None else environ
    declared = declared_parameters(name)
    return {
        parameter: project_path(parameter, yaml.safe_load(environ[ENV_PREFIX + parameter.upper()]), root)
        for parameter in declared
        if ENV_PREFIX + parameter.upper() in environ
    }


def project_path(parameter: str, value: Any, root: Path = PROJECT_DIR) -> Any:
    """``value`` as the notebook kernel (working directory ``notebooks/``) must see a path given relative to ``root``.

    ``data_dir``, ``run_dir`` and ``model_dir`` are always paths; ``model`` and ``source`` only when ``root``
    has that path (``t5-small`` and ``sample`` stay names). Anything else is returned as it is.

    Usage::

        >>> project_path("data_dir", "runs/cml/data", Path("/home/cdsw"))
        '/home/cdsw/runs/cml/data'

    :param parameter: the parameter's name.
    :param value: its value.
    :param root: the project root.
    :rtype: Any
    """
    if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
        return value
    candidate = root / value
    if parameter in PATH_PARAMETERS or (parameter in PATH_OR_NAME_PARAMETERS and candidate.exists()):
        return os.path.normpath(candidate)
    return value


def job_parameters(
    overrides: Mapping[str, Mapping[str, Any]] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Every notebook's parameters as a job would run it: the notebook's defaults, then ``TEXTSQL_<NAME>``
    from the environment (:func:`parameters_from_environ`), then ``overrides``.

    :param overrides: per-notebook values (:func:`parse_overrides`).
    :param environ: the environment to read (``os.environ`` when None).
    :rtype: dict
    """
    chosen = {}
    for name in NOTEBOOKS:
        declared = declared_parameters(name)
        chosen[name] = {parameter: ast.literal_eval(spec["default"]) for parameter, spec in declared.items()}
        chosen[name].update(parameters_from_environ(name, environ))
        chosen[name].update((overrides or {}).get(name, {}))
    return chosen


def runtime_checks(chosen: Mapping[str, Mapping[str, Any]]) -> list:
    """What this runtime has and lacks for notebooks 01 and 02 with these parameters (:func:`textsql.launching.preflight.check_runtime`).

    :param chosen: every notebook's parameters (:func:`job_parameters`).
    :rtype: list[textsql.launching.preflight.Check]
    """
    from textsql.launching.preflight import check_runtime

    prepare, train = chosen["01_prepare_dataset"], chosen["02_train_distributed"]
    return check_runtime(
        model=prepare["model"],
        source=prepare["source"],
        backend=train["backend"],
        worker_gpus=train["worker_gpus"],
        training_model=train["model"],
    )


def run_notebook(
    name: str, output: str | Path, parameters: Mapping[str, Any] | None = None, log_output: bool = True
) -> Path:
    """Execute one notebook with papermill and write the executed copy to ``output``.

    The kernel runs in ``notebooks/`` (as in JupyterLab), with this Python's ``python3`` kernel.

    Usage::

        >>> run_notebook("01_prepare_dataset", "runs/x/01_prepare_dataset.ipynb", {"data_dir": "/abs/runs/x/data"})

    :param name: the notebook.
    :param output: path of the executed notebook.
    :param parameters: values for the notebook's ``parameters`` cell.
    :param log_output: stream the cells' output to this process's log as they run.
    :rtype: pathlib.Path
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    check_parameters(name, parameters or {})
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    logger.debug("running %s -> %s with %s", name, output, dict(parameters or {}))
    try:
        papermill.execute_notebook(
            str(notebook_path(name)),
            str(output),
            parameters=dict(parameters or {}),
            kernel_name=KERNEL_NAME,
            cwd=str(NOTEBOOKS_DIR),
            log_output=log_output,
            progress_bar=False,
            extra_arguments=KERNEL_ARGUMENTS,
        )
    except PapermillExecutionError as error:
        raise NotebookError(
            f"notebook {name} failed in cell {error.exec_count}: {error.ename}: {error.evalue}; open {output}"
        ) from None
    return output


def check_parameters(name: str, parameters: Mapping[str, Any]) -> None:
    """Refuse parameters the notebook does not declare (papermill would only warn and run without them).

    :param name: the notebook.
    :param parameters: the values about to be passed.
    :raises NotebookError: naming the unknown parameters and the notebook's own.
    """
    declared = declared_parameters(name)
    unknown = sorted(set(parameters) - set(declared))
    if unknown:
        raise NotebookError(
            f"notebook {name} has no parameter {', '.join(map(repr, unknown))}; its parameters are {', '.join(declared)}"
        )


def demo_parameters(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The embedded-default run: questions synthesised over the sample's tables, the small T5, two local worker
    pods, the default profile; then the sample's real validation questions answered beside the synthetic ones.

    Model and profile are left to notebook 02's defaults (:func:`textsql.arguments.notebook_defaults`):
    the profile ``auto`` is what the notebook's estimate recommends.

    :param out_dir: where everything goes (absolute).
    :rtype: dict
    """
    data_dir = str(out_dir / "data")
    return {
        # The small T5 starts from random weights: trained on the sample's 1,000 questions it memorises their
        # 250 tables; synthetic questions vary the names it must copy more than it can memorise, and the
        # uncased form spells a column alike in question, header and query (README, "What `make demo` does").
        "01_prepare_dataset": {
            "source": "synthetic",
            "input_format": "uncased",
            "model": "default",
            "data_dir": data_dir,
        },
        "02_train_distributed": {
            "data_dir": data_dir,
            "run_dir": str(out_dir),
            "backend": "local",
            "workers": 2,
            # About 5.5 minutes of steps on two CPU cores, at the constant rate of TRAINING_DEFAULTS: held-out
            # logical form rises from 6 % at step 1,000 to 33 % at 1,500 and past 50 % at 2,000.
            "learning_rate": 1e-3,
            "max_steps": 2000,
            "eval_steps": 500,
        },
        "03_inference": {"data_dir": data_dir, "run_dir": str(out_dir), "real_source": "sample"},
    }


def parse_overrides(entries: list[str]) -> dict[str, dict[str, Any]]:
    """Per-notebook parameters from ``NAME=VALUE`` (every notebook that declares NAME) or
    ``NOTEBOOK.NAME=VALUE`` (that notebook only); values are read as YAML (``4``, ``true``, ``null``).

    :param entries: the command line's ``-p`` values.
    :rtype: dict
    """
    declared = {name: set(declared_parameters(name)) for name in NOTEBOOKS}
    overrides: dict[str, dict[str, Any]] = {name: {} for name in NOTEBOOKS}
    for entry in entries:
        key, separator, text = entry.partition("=")
        notebook, _, parameter = key.rpartition(".")
        targets = (
            [notebook_path(notebook).stem] if notebook else [name for name in NOTEBOOKS if parameter in declared[name]]
        )
        if not separator or not targets or any(parameter not in declared[name] for name in targets):
            known = sorted(set().union(*declared.values()))
            raise NotebookError(
                f"-p {entry!r} sets no notebook parameter; write NAME=VALUE with NAME one of {', '.join(known)}"
            )
        for name in targets:
            overrides[name][parameter] = yaml.safe_load(text)
    return overrides


def check_training_parameters(chosen: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse notebook 02's profile, model and data_dir before any notebook runs, so before any worker starts.

    The data_dir notebook 01 is about to write is not checked; any other one must hold a prepared dataset now.

    :param chosen: every notebook's parameters, as :func:`run_demo` will pass them.
    :raises TextSQLError: a ProfileError, ModelError or DataError naming the fix.
    """
    from textsql.arguments import ModelArguments, RunArguments, argument_field

    training = dict(chosen["02_train_distributed"])
    # The profile first: it is the cheap check and the common typo, refused before torch is imported.
    profile = training.get("profile", argument_field(RunArguments, "profile").default)
    if profile != AUTO_PROFILE:
        get_profile(profile)
    from textsql.files import check_prepared
    from textsql.model import load_config

    load_config(training.get("model", argument_field(ModelArguments, "model").default))
    if training["data_dir"] != chosen["01_prepare_dataset"]["data_dir"]:
        check_prepared(training["data_dir"])


def run_demo(out_dir: str | Path, parameters: Mapping[str, Mapping[str, Any]] | None = None) -> DemoResult:
    """Run the three notebooks in order on the embedded default; everything lands under ``out_dir``.

    A previous demo in ``out_dir`` is replaced; any other existing, non-empty directory is refused.
    The training parameters are checked first (:func:`check_training_parameters`), so a mistake
    there leaves ``out_dir`` as it was and starts no worker.

    :param out_dir: run directory (``runs/demo``).
    :param parameters: per-notebook overrides merged onto :func:`demo_parameters`.
    :raises TextSQLError: a ProfileError, ModelError or DataError from the check, or a NotebookError.
    :rtype: DemoResult
    """
    out_dir = Path(out_dir).expanduser().resolve()
    chosen = demo_parameters(out_dir)
    for name, overrides in (parameters or {}).items():
        chosen[notebook_path(name).stem].update(overrides)
    check_training_parameters(chosen)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not (out_dir / DEMO_MARKER).is_file():
            raise NotebookError(f"{str(out_dir)!r} exists and is not a previous demo; pass another --out")
        logger.warning("replacing the previous demo in %s", out_dir)
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / DEMO_MARKER).touch()
    for name in LOG_LEVEL_NOTEBOOKS:
        chosen[name].setdefault("log_level", log_level())
    result = DemoResult(out_dir)
    view = StageView(len(NOTEBOOKS), live=not is_verbose())
    quiet = contextlib.nullcontext() if is_verbose() else cell_output_to(out_dir / DEMO_LOG_NAME, view)
    if not is_verbose():
        view.stream.write(f"The cells' output goes to {out_dir / DEMO_LOG_NAME} (--verbose shows it here)\n")
    with quiet:
        for name in NOTEBOOKS:
            started = time.monotonic()
            with view.stage(name):
                result.notebooks[name] = run_notebook(name, out_dir / "notebooks" / f"{name}.ipynb", chosen[name])
            result.seconds[name] = time.monotonic() - started
    return result


def format_summary(result: DemoResult) -> str:
    """What the demo produced, how training and scoring went, what to open next, and where the time went.

    :param result: what :func:`run_demo` returned.
    :rtype: str
    """
    out = result.out_dir
    lines = [f"Everything is under {out}:"]
    for name in (HOSTFILE_NAME, LAUNCH_LOG_NAME, "tensorboard", "model", PREDICTIONS_NAME, METRICS_NAME):
        lines.append(f"  {name:18} {'ok' if (out / name).exists() else 'MISSING'}")
    training = _read_json(out / RUN_SUMMARY_NAME)
    losses = [entry["loss"] for entry in training.get("log_history", []) if "loss" in entry]
    if losses:
        lines.append(f"Train loss {losses[0]:.2f} -> {losses[-1]:.2f} over {training['global_step']} steps")
    prepared = _read_json(out / "data" / PREPARE_JSON_NAME)
    for title, metrics in (
        (f"{prepared.get('source', 'prepared')} questions", _read_json(out / METRICS_NAME)),
        ("real questions (real_source)", _read_json(out / REAL_METRICS_NAME)),
    ):
        lines += _score_lines(title, metrics)
    lines += [
        "Open next:",
        f"  {_command('textsql')} tensorboard --logdir {_shown(out / 'tensorboard')}",
        *(f"  {_command('jupyter')} lab {_shown(path)}" for path in result.notebooks.values()),
        "Time:",
    ]
    runtime = next(
        (entry["train_runtime"] for entry in training.get("log_history", []) if "train_runtime" in entry), None
    )
    for name, seconds in result.seconds.items():
        lines.append(f"  {name:22} {seconds:7.1f} s")
        if name == "02_train_distributed" and runtime is not None:
            lines.append(
                f"    of which {runtime:.0f} s optimizer steps on {training['world_size']} ranks, ZeRO-{training['zero_stage']}"
            )
    lines.append(f"  {'total':22} {sum(result.seconds.values()):7.1f} s")
    return "\n".join(lines)


def _score_lines(title: str, metrics: dict) -> list[str]:
    """Logical-form and execution accuracy, parse rate and each part beside the trivial baseline, of one metrics.json."""
    if not metrics:
        return []
    ex = metrics.get("ex_accuracy")
    execution = "n/a (the tables carry no rows)" if ex is None else f"{ex:.1%}"
    lines = [f"Scores on {metrics['n']} {title}: logical form {metrics['lf_accuracy']:.1%}, execution {execution}"]
    if metrics.get("parse_rate") is not None:
        lines.append(f"  parsed as queries over their table: {metrics['parse_rate']:.1%}")
    parts = metrics.get("components") or {}
    baseline = (metrics.get("baseline") or {}).get("components") or {}
    if parts:
        lines.append(
            "  parts right: "
            + ", ".join(
                f"{name} {value:.1%}" + (f" (baseline {baseline[name]:.1%})" if name in baseline else "")
                for name, value in parts.items()
            )
        )
    return lines


def _read_json(path: Path) -> dict:
    # A run that failed part-way leaves some files out; the summary says MISSING above instead.
    return read_json(path) if path.is_file() else {}


def _shown(path: Path) -> str:
    """A path relative to the working directory when it is below it (shorter to copy), else absolute."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _command(name: str) -> str:
    """This environment's executable ``name`` (``.venv/bin/textsql``), as a user would type it."""
    return _shown(Path(sys.executable).parent / name)
