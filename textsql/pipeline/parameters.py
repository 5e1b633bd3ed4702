"""The notebooks' parameters: what each notebook declares, and the values a job or the demo chooses for them.

A notebook's cell tagged ``parameters`` is the one place its parameters, defaults and help are written down;
this module reads them (as papermill does), takes values from ``TEXTSQL_<NAME>`` environment variables and
from ``-p [NOTEBOOK.]NAME=VALUE``, and refuses a name no notebook declares before anything runs.

A parameters cell must hold literals, so notebook 02's repeat the training defaults: :func:`notebook_defaults`
names those defaults as the notebook does, from the argument dataclasses, and ``tests/test_defaults.py``
fails when the notebook drifts from them. What notebook 02's parameters resolve to on the master (the profile
``auto`` picks, the precision, the ranks: :func:`resolved_training`) is what a continuation pins.
"""

from __future__ import annotations

import ast
import difflib
import os
from collections.abc import Mapping
from contextlib import chdir
from pathlib import Path
from typing import Any

import yaml

from textsql.arguments import TRAINING_DEFAULTS, ModelArguments, RunArguments, argument_field
from textsql.constants import DEFAULT_MAX_RESTARTS, DEFAULT_REPLACE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, PROJECT_DIR
from textsql.errors import TextSQLError
from textsql.json_files import read_json
from textsql.planning.profiles import AUTO_PROFILE

NOTEBOOKS_DIR = PROJECT_DIR / "notebooks"
NOTEBOOKS = ("01_prepare_dataset", "02_train_distributed", "03_inference")
# Any notebook parameter can be set from the environment as TEXTSQL_<PARAMETER> (CML job and project
# variables, the AMP's defaults); values are read as YAML so numbers and booleans keep their type.
ENV_PREFIX = "TEXTSQL_"
# Parameters that name a path, and those that name a path or something else (a hub id, "sample"). Set in the
# environment (a CML job, the AMP) a relative one is relative to the project root, where CML runs jobs and
# where users think; the kernel itself runs in notebooks/ as in JupyterLab.
PATH_PARAMETERS = ("data_dir", "run_dir", "model_dir")
PATH_OR_NAME_PARAMETERS = ("model", "source", "real_source")
# Parameters of the previous release and what they are now (refused with the new name, for one release).
RENAMED_PARAMETERS = {"resume": "resume_from_checkpoint"}


class NotebookError(TextSQLError):
    """A notebook's name or parameters are wrong, or a notebook run by papermill failed."""


# What precision auto resolves to on workers with GPUs, as the master can tell: each rank picks by its GPU.
GPU_PRECISION = "bf16 or fp32, by the GPU"


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
    ``tests/test_notebooks.py`` holds the two readers to the same answer for every notebook.

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


def declared_defaults(name: str) -> dict[str, Any]:
    """The notebook's parameters and their default values, as a Run All in JupyterLab uses them.

    :param name: the notebook.
    :rtype: dict
    """
    return {parameter: ast.literal_eval(spec["default"]) for parameter, spec in declared_parameters(name).items()}


def notebook_defaults() -> dict[str, Any]:
    """The defaults of notebook 02's training parameters, by the notebook's names, from their one source: the
    argument dataclasses' fields and :data:`textsql.arguments.TRAINING_DEFAULTS`.

    Its schedule (``max_steps``, ``eval_steps``) is the notebook's own: a run of the small T5 that learns on CPUs
    in minutes, where ``textsql train`` keeps Seq2SeqTrainingArguments' three epochs.

    Usage::

        >>> notebook_defaults()["profile"]
        'auto'

    :rtype: dict[str, typing.Any]
    """
    from transformers import Seq2SeqTrainingArguments

    return {
        "profile": argument_field(RunArguments, "profile").default,
        "model": argument_field(ModelArguments, "model").default,
        "per_device_train_batch_size": TRAINING_DEFAULTS["per_device_train_batch_size"],
        # None: the model's recipe decides (textsql.planning.recipe: from its config or with weights).
        "learning_rate": None,
        "seed": argument_field(Seq2SeqTrainingArguments, "seed").default,
        "eval_share": argument_field(RunArguments, "eval_share").default,
        "save_every_minutes": argument_field(RunArguments, "save_every_minutes").default,
        "overwrite_output_dir": argument_field(RunArguments, "overwrite_output_dir").default,
        "max_restarts": DEFAULT_MAX_RESTARTS,
        # None: every worker, so a lost worker that is not replaced ends the run (textsql.launching.recovery).
        "min_workers": None,
        "replace_timeout": DEFAULT_REPLACE_TIMEOUT_S,
        "stall_timeout": DEFAULT_STALL_TIMEOUT_S,
        "report_to": TRAINING_DEFAULTS["report_to"],
    }


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
    for old, new in RENAMED_PARAMETERS.items():
        if ENV_PREFIX + old.upper() in environ:
            raise NotebookError(f"{ENV_PREFIX}{old.upper()} was renamed {ENV_PREFIX}{new.upper()}: set that instead")
    declared = declared_parameters(name)
    return {
        parameter: project_path(parameter, yaml.safe_load(environ[ENV_PREFIX + parameter.upper()]), root)
        for parameter in declared
        if ENV_PREFIX + parameter.upper() in environ
    }


def project_path(parameter: str, value: Any, root: Path = PROJECT_DIR) -> Any:
    """``value`` as the notebook kernel (working directory ``notebooks/``) must see a path given relative to ``root``.

    ``data_dir``, ``run_dir`` and ``model_dir`` are always paths; ``model``, ``source`` and ``real_source`` only
    when ``root`` has that path (``t5-small`` and ``sample`` stay names). Anything else is returned as it is.

    Usage::

        >>> project_path("data_dir", "runs/cml-data", Path("/home/cdsw"))
        '/home/cdsw/runs/cml-data'

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
        chosen[name] = declared_defaults(name)
        chosen[name].update(parameters_from_environ(name, environ))
        chosen[name].update((overrides or {}).get(name, {}))
    return chosen


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
            # Names that changed (per_device_batch_size, overwrite in notebook 02) are a typo away from the new ones.
            close = [RENAMED_PARAMETERS[parameter]] if parameter in RENAMED_PARAMETERS else []
            close = close or difflib.get_close_matches(parameter, known, n=1)
            raise NotebookError(
                f"-p {entry!r} sets no notebook parameter{f' (did you mean {close[0]}?)' if close else ''}; "
                f"write NAME=VALUE with NAME one of {', '.join(known)}"
            )
        for name in targets:
            overrides[name][parameter] = yaml.safe_load(text)
    return overrides


def resolved_training(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """What notebook 02's parameters resolve to on the master: the profile (``auto``: the one the notebook's estimate
    picks for its workers, :func:`textsql.planning.estimate.workers_estimate`), the precision (``auto``, which each
    rank resolves from its device: fp32 on CPUs; on GPUs bf16 where the GPU has it, else fp32,
    :func:`textsql.planning.train_args.resolve_precision`) and the ranks, workers x GPUs per worker (one rank a
    worker on CPUs).

    :param parameters: the notebook's effective parameters.
    :rtype: dict
    :raises ProfileError: ``auto`` when no profile fits the workers, naming the fix.
    """
    profile = parameters["profile"]
    if profile == AUTO_PROFILE:
        from textsql.planning.estimate import choose_profile, workers_estimate

        with chdir(NOTEBOOKS_DIR):  # a model directory is relative to the notebook, as its kernel reads it
            report = workers_estimate(
                parameters["model"],
                parameters["workers"],
                parameters["worker_gpus"],
                parameters["gpu_memory_gb"],
                parameters["worker_memory"],
            )
        profile = choose_profile(profile, report)
    return {
        "profile": profile,
        "precision": GPU_PRECISION if parameters["worker_gpus"] else "fp32",
        "ranks": parameters["workers"] * max(parameters["worker_gpus"], 1),
    }
