"""``textsql demo`` (``make demo``): the three notebooks run in order on their own defaults, everything under one
directory and the prepared dataset beside it, then a summary of what it produced, how training and scoring went,
and where the time went.

The notebooks stay the single place the workflow and its defaults are written down: the demo passes only
where its files go (and the log level under ``--verbose``; under ``--resume``, what continues or replaces an
earlier run: :mod:`textsql.pipeline.manifest`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textsql.console import DEFAULT_LOG_LEVEL, is_verbose, log_level
from textsql.constants import (
    LAUNCH_LOG_NAME,
    METRICS_NAME,
    PREDICTIONS_NAME,
    PREPARE_JSON_NAME,
    REAL_METRICS_NAME,
    RUN_SUMMARY_NAME,
)
from textsql.display.terminal import StageView, cell_output_to
from textsql.json_files import read_json
from textsql.pipeline.manifest import Manifest, Step
from textsql.pipeline.parameters import NOTEBOOKS, NotebookError, declared_defaults, notebook_path
from textsql.pipeline.runs import continuation_plan, end_earlier_attempt, run_recorded
from textsql.planning.profiles import run_profile
from textsql.rundir.master_state import master_dir
from textsql.sanitize import sanitized
from worker.constants import HOSTFILE_NAME

logger = logging.getLogger(__name__)

# Marks a directory as the demo's own, so a second `make demo` may replace it (and nothing else).
DEMO_MARKER = ".textsql-demo"
# The cells' output of a demo at the default log level (the executed notebooks hold it too).
DEMO_LOG_NAME = "demo.log"
# The prepared dataset's directory is the run directory's name with this added, beside it.
DATA_DIR_SUFFIX = "-data"
# How `textsql demo` takes notebook 02's profile, as its refusal names it.
DEMO_PROFILE_FLAG = "-p profile="


@dataclass
class DemoResult:
    """What ``make demo`` produced, and how long each notebook took."""

    out_dir: Path
    seconds: dict[str, float] = field(default_factory=dict)
    notebooks: dict[str, Path] = field(default_factory=dict)


def demo_parameters(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Where the demo's notebooks write and read: everything else is the notebooks' own defaults (questions
    synthesised over the sample's tables, uncased, the small T5, two local worker pods, profile auto, 1,800
    steps; then the sample's real questions answered beside the synthetic ones).

    :param out_dir: the run directory (absolute); the prepared dataset goes beside it (:func:`demo_data_dir`).
    :rtype: dict
    """
    paths = {"data_dir": str(demo_data_dir(out_dir)), "run_dir": str(out_dir)}
    return {
        "01_prepare_dataset": {"data_dir": paths["data_dir"]},
        "02_train_distributed": dict(paths),
        "03_inference": dict(paths),
    }


def demo_data_dir(out_dir: Path) -> Path:
    """Where the demo prepares its questions: beside its run directory (``runs/demo-data``), not in it, since the
    worker pods may write the run directory and notebook 03 shows the questions.

    :param out_dir: the demo's run directory.
    :rtype: pathlib.Path
    """
    return out_dir.with_name(out_dir.name + DATA_DIR_SUFFIX)


def check_training_parameters(chosen: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse notebook 02's profile, model and data_dir before any notebook runs, so before any worker starts.

    The data_dir notebook 01 is about to write is not checked; any other one must hold a prepared dataset now.

    :param chosen: the values :func:`run_demo` will pass each notebook; the rest are the notebook's defaults.
    :raises TextSQLError: a ProfileError, ModelError or DataError naming the fix.
    """
    training = {**declared_defaults("02_train_distributed"), **chosen["02_train_distributed"]}
    # The profile first: it is the cheap check and the common typo, refused before torch is imported.
    run_profile(training["profile"], DEMO_PROFILE_FLAG)
    from textsql.data.tables import check_prepared
    from textsql.model import load_config

    load_config(training["model"])
    prepared = {**declared_defaults("01_prepare_dataset"), **chosen["01_prepare_dataset"]}["data_dir"]
    if training["data_dir"] != prepared:
        check_prepared(training["data_dir"])


def run_demo(
    out_dir: str | Path, parameters: Mapping[str, Mapping[str, Any]] | None = None, continue_demo: bool = False
) -> DemoResult:
    """Run the three notebooks in order on their defaults; everything lands under ``out_dir``, but the prepared
    dataset, beside it (:func:`demo_data_dir`).

    A previous demo in ``out_dir`` is replaced (its dataset by notebook 01's), once what a hard kill of it left
    running is ended (refused while it still runs: :func:`textsql.pipeline.runs.end_earlier_attempt`); any other
    existing, non-empty directory there or where the dataset goes is refused.
    With ``continue_demo`` (``--resume``) it is continued instead (:func:`textsql.pipeline.runs.continuation_plan`): a
    notebook that completed with the same parameters is skipped (one line says so), training resumes from its newest
    complete checkpoint, the rest run. The training parameters are checked first (:func:`check_training_parameters`),
    so a mistake there leaves ``out_dir`` as it was and starts no worker.

    :param out_dir: run directory (``runs/demo``).
    :param parameters: per-notebook overrides merged onto :func:`demo_parameters`.
    :param continue_demo: continue the demo in ``out_dir`` rather than replace it.
    :raises TextSQLError: a ProfileError, ModelError or DataError from the check, or a NotebookError.
    :rtype: DemoResult
    """
    out_dir = Path(out_dir).expanduser().resolve()
    chosen = demo_parameters(out_dir)
    for name, overrides in (parameters or {}).items():
        chosen[notebook_path(name).stem].update(overrides)
    for directory in (out_dir, demo_data_dir(out_dir)):
        if directory.is_dir() and any(directory.iterdir()) and not (out_dir / DEMO_MARKER).is_file():
            raise NotebookError(f"{str(directory)!r} exists and is not a previous demo; pass another --run-dir")
    # Before the checks, which import transformers: a killed demo's ranks may still be training meanwhile.
    if continue_demo:
        manifest, steps = continuation_plan(out_dir, chosen)
    else:
        end_earlier_attempt(out_dir)
    check_training_parameters(chosen)
    if not continue_demo:
        if out_dir.is_dir() and any(out_dir.iterdir()):
            logger.warning("replacing the previous demo in %s", out_dir)
            shutil.rmtree(out_dir)
        # The checks above refused a dataset directory that is not a replaced demo's: notebook 01 writes it anew.
        shutil.rmtree(demo_data_dir(out_dir), ignore_errors=True)
        shutil.rmtree(master_dir(out_dir))  # the replaced demo's record and launch ids
        manifest, steps = Manifest(out_dir), {name: Step("run", "a new demo") for name in NOTEBOOKS}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / DEMO_MARKER).touch()
    manifest.begin()
    if log_level() != DEFAULT_LOG_LEVEL:  # --verbose: the cells show third-party output too
        for name in NOTEBOOKS:
            chosen[name].setdefault("log_level", log_level())
    result = DemoResult(out_dir)
    running = [name for name in NOTEBOOKS if steps[name].runs]
    # Notebook 02 shows its steps as a bar of its own: the terminal reads them from the run's launch.log.
    view = StageView(len(running), live=not is_verbose(), follow=out_dir / LAUNCH_LOG_NAME, run_dir=out_dir)
    quiet = contextlib.nullcontext() if is_verbose() else cell_output_to(out_dir / DEMO_LOG_NAME, view)
    for name in NOTEBOOKS:
        result.notebooks[name] = out_dir / "notebooks" / f"{name}.ipynb"
        if not steps[name].runs:
            view.stream.write(f"{name} skipped: {steps[name].reason}\n")
        elif continue_demo:
            view.stream.write(f"{name} runs: {steps[name].reason}\n")
    if not is_verbose() and running:
        view.stream.write(f"The cells' output goes to {out_dir / DEMO_LOG_NAME} (--verbose shows it here)\n")
    with quiet:
        for name in running:
            started = time.monotonic()
            with view.stage(name):
                run_recorded(manifest, name, result.notebooks[name], chosen[name], steps[name])
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
    lines.append(f"The prepared questions are beside it, in {demo_data_dir(out)}")
    training = _read_json(out / RUN_SUMMARY_NAME)
    losses = [entry["loss"] for entry in training.get("log_history", []) if "loss" in entry]
    if losses:
        lines.append(f"Train loss {losses[0]:.2f} -> {losses[-1]:.2f} over {training['global_step']} steps")
    prepared = _read_json(demo_data_dir(out) / PREPARE_JSON_NAME)
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
    for name in result.notebooks:
        if name not in result.seconds:
            lines.append(f"  {name:22} skipped (done before)")
            continue
        seconds = result.seconds[name]
        lines.append(f"  {name:22} {seconds:7.1f} s")
        if name == "02_train_distributed" and runtime is not None:
            lines.append(
                f"    of which {runtime:.0f} s optimizer steps on {training['world_size']} ranks, ZeRO-{training['zero_stage']}"
            )
    lines.append(f"  {'total':22} {sum(result.seconds.values()):7.1f} s")
    # Its values come from files the pods may write (run.json, prepare.json, metrics.json): shown inert.
    return "\n".join(sanitized(line) for line in lines)


def _score_lines(title: str, metrics: dict) -> list[str]:
    """Logical-form and execution accuracy, parse rate and each part beside the trivial baseline, of one metrics.json."""
    if not metrics:
        return []

    def scored(key: str) -> str:
        error = metrics.get(f"{key}_standard_error")
        return f"{metrics[f'{key}_accuracy']:.1%}" + (f" ± {100 * error:.1f}" if isinstance(error, float) else "")

    execution = "n/a (the tables carry no rows)" if metrics.get("ex_accuracy") is None else scored("ex")
    lines = [f"Scores on {metrics['n']} {title}: logical form {scored('lf')}, execution {execution}"]
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
