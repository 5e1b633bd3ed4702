"""One source of every default a user sees: the CLI, the notebooks, the demo and the AMP say what the dataclasses say.

A notebook's parameters and the AMP's environment defaults must be literals, so they repeat the values;
these tests fail as soon as a copy drifts from the dataclass fields and TRAINING_DEFAULTS, and as soon as a
notebook gains a parameter that is neither compared nor named below with the reason it has no counterpart.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import click
import papermill
import pytest
import yaml

from textsql.arguments import GenerationOptions, PrepareArguments, argument_field, train_argv
from textsql.cli import cli
from textsql.launching.command import LaunchArguments
from textsql.pipeline.demo import demo_parameters
from textsql.pipeline.parameters import ENV_PREFIX, NOTEBOOKS, PATH_PARAMETERS, notebook_defaults, notebook_path
from textsql.planning.recipe import FROM_CONFIG_RECIPE
from textsql.planning.train_args import parse_command_line
from worker.backends.base import Resources

PROJECT_DIR = Path(__file__).resolve().parent.parent
AMP_VARIABLES = yaml.safe_load((PROJECT_DIR / ".project-metadata.yaml").read_text())["environment_variables"]
# Where the AMP differs on purpose: it runs on CML GPU workers with the model hub in reach, not on this
# machine's local CPU pods with the embedded random-weight T5, so it prepares real questions with their case
# for a pretrained T5 and trains three epochs; its paths are the CML project's; and a job started again
# continues what the failed one left (the job chain and the training: TEXTSQL_RESUME_FROM_CHECKPOINT=auto).
AMP_PLATFORM = {
    "backend",
    "worker_cpu",
    "worker_memory",
    "worker_gpus",
    "model",
    "data_dir",
    "run_dir",
    "source",
    "input_format",
    "max_steps",
    "eval_steps",
    "real_source",
    "resume_from_checkpoint",
}
# Where a notebook differs from its command on purpose: Run All must learn with the small T5 from random
# weights on CPUs (what `textsql demo` runs), so notebook 01 prepares its synthetic, uncased questions;
# `textsql prepare` keeps the real sample as it is.
LEARNS_ON_RUN_ALL = {("01_prepare_dataset", "source"), ("01_prepare_dataset", "input_format")}


# Each notebook, the commands that do what it does (the README's "same as"), and the dataclass whose fields
# give those commands' options their defaults (None: the command's own options).
NOTEBOOK_COMMANDS = {
    "01_prepare_dataset": {"prepare": PrepareArguments},
    "02_train_distributed": {"launch": LaunchArguments, "estimate": None},
    "03_inference": {"infer": GenerationOptions},
}
# Options a command names apart from their field (and the notebook's parameter): field -> the option's name.
RENAMED_OPTIONS = {("prepare", "model"): "tokenizer"}
# Notebook parameters whose default is a dataclass's though no command takes them.
DATACLASS_ONLY = {
    ("02_train_distributed", "worker_cpu"): Resources().cpu,
    ("02_train_distributed", "worker_memory"): Resources().memory_gb,
    ("02_train_distributed", "worker_gpus"): Resources().gpus,
    ("02_train_distributed", "resume_from_checkpoint"): None,
}
# Notebook parameters with no counterpart elsewhere, and why.
NOTEBOOK_ONLY = {
    "log_level": "the CLI's --verbose sets the same level for a command",
    "data_dir": "paths relative to notebooks/: each command names its own (--data-dir, --run-dir)",
    "run_dir": "paths relative to notebooks/: each command names its own (--data-dir, --run-dir)",
    "model_dir": "notebook 03 answers with its run's model (run_dir/model); `textsql infer --run-dir` has no default",
    "backend": "the workers: notebook 02 starts them (and `textsql demo` runs it), no command does",
    "workers": "the workers: notebook 02 starts them (and `textsql demo` runs it), no command does",
    "backend_options": "the workers: notebook 02 starts them (and `textsql demo` runs it), no command does",
    "gpu_memory_gb": "the estimate for the GPUs of the pods it starts; `textsql estimate` reads the machine it runs on",
    "question": "notebook 03's example of a question of your own; `textsql infer` answers one only with --question",
    "header": "notebook 03's example of a question of your own; `textsql infer` answers one only with --question",
    "real_source": "notebook 03 scores a second source apart (run `textsql infer` again with its --source for the same)",
    "max_steps": "notebook 02's schedule fits the small T5 learning on CPUs in minutes; `textsql train` keeps three epochs",
    "eval_steps": "notebook 02's schedule fits the small T5 learning on CPUs in minutes; `textsql train` keeps three epochs",
}


def cli_defaults(command: str) -> dict:
    """The command's options and their defaults (click's "no default" read as None), by their fields' names."""
    fields_of = {option: name for (owner, name), option in RENAMED_OPTIONS.items() if owner == command}
    params = cli.commands[command].params
    return {
        fields_of.get(p.name, p.name): (None if p.default is click.core.UNSET else p.default)
        for p in params
        if p.name != "help"
    }


def notebook_parameter_defaults(name: str) -> dict:
    return {
        parameter: ast.literal_eval(spec["default"])
        for parameter, spec in papermill.inspect_notebook(str(notebook_path(name))).items()
    }


def test_notebook_02_parameters_are_the_one_source():
    declared = notebook_parameter_defaults("02_train_distributed")
    assert {name: declared[name] for name in notebook_defaults()} == notebook_defaults()
    assert notebook_defaults()["profile"] == "auto"


def test_the_cli_trains_with_the_same_defaults(tmp_path):
    model_args, _, run_args, training = parse_command_line(train_argv(data_dir=str(tmp_path), run_dir=str(tmp_path)))
    defaults = notebook_defaults()
    assert run_args.auto_profile and model_args.model == defaults["model"]
    # Neither sets a rate: the default model is built from its config, so both train at its recipe's.
    assert defaults["learning_rate"] is None and training["learning_rate"] == FROM_CONFIG_RECIPE.learning_rate
    assert (
        training["per_device_train_batch_size"],
        training["seed"],
        run_args.eval_share,
        run_args.save_every_minutes,
        run_args.overwrite_output_dir,
    ) == (
        defaults["per_device_train_batch_size"],
        defaults["seed"],
        defaults["eval_share"],
        defaults["save_every_minutes"],
        defaults["overwrite_output_dir"],
    )


def test_the_demo_sets_only_where_its_files_go(tmp_path):
    for notebook, values in demo_parameters(tmp_path).items():
        assert set(values) <= set(PATH_PARAMETERS), f"the demo overrides {notebook}'s defaults; change the notebook's"


def test_the_prepared_questions_lie_outside_the_directory_the_pods_write(tmp_path):
    """Notebook 03 shows the questions it reads from data_dir, and the pods write run_dir (on Kubernetes the one
    directory they mount read-write): by default the one is never inside the other, in the notebooks, the demo
    and the AMP."""
    notebooks = Path(notebook_path("03_inference")).parent
    defaults = {name: notebook_parameter_defaults(name) for name in ("02_train_distributed", "03_inference")}
    pairs = {
        f"notebook {name}": (notebooks / found["data_dir"], notebooks / found["run_dir"])
        for name, found in defaults.items()
    }
    for name, chosen in demo_parameters(tmp_path / "demo").items():
        if "run_dir" in chosen:
            pairs[f"the demo's {name}"] = (Path(chosen["data_dir"]), Path(chosen["run_dir"]))
    amp = {variable: Path(spec["default"]) for variable, spec in AMP_VARIABLES.items() if variable.endswith("_DIR")}
    pairs["the AMP"] = (amp[f"{ENV_PREFIX}DATA_DIR"], amp[f"{ENV_PREFIX}RUN_DIR"])
    inside = [owner for owner, (data, run) in pairs.items() if data.resolve().is_relative_to(run.resolve())]
    assert inside == [], "data_dir lies in run_dir"


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_notebook_parameter_has_the_default_of_the_cli_and_the_dataclass(notebook):
    declared = notebook_parameter_defaults(notebook)
    training = notebook_defaults() if notebook == "02_train_distributed" else {}  # compared in the tests above
    compared, drifted = set(), []
    for command, arguments in NOTEBOOK_COMMANDS[notebook].items():
        for name, default in cli_defaults(command).items():
            if (
                name not in declared
                or name in training
                or name in NOTEBOOK_ONLY
                or (notebook, name) in LEARNS_ON_RUN_ALL
            ):
                continue
            compared.add(name)
            if declared[name] != default:
                drifted.append(f"{notebook}'s {name} = {declared[name]!r}, `textsql {command}` says {default!r}")
            if arguments is not None and name in {spec.name for spec in fields(arguments)}:
                field_default = argument_field(arguments, name).default
                if declared[name] != field_default:
                    drifted.append(
                        f"{notebook}'s {name} = {declared[name]!r}, {arguments.__name__} says {field_default!r}"
                    )
    for (owner, name), default in DATACLASS_ONLY.items():
        if owner == notebook:
            compared.add(name)
            if declared[name] != default:
                drifted.append(f"{notebook}'s {name} = {declared[name]!r}, its dataclass says {default!r}")
    assert drifted == []
    learns = {name for owner, name in LEARNS_ON_RUN_ALL if owner == notebook}
    unaccounted = set(declared) - compared - set(training) - set(NOTEBOOK_ONLY) - learns
    assert not unaccounted, f"{notebook}'s parameters {sorted(unaccounted)} are compared with nothing: add them above"


def test_the_amp_environment_defaults_are_the_notebooks():
    declared = {
        name: default for notebook in NOTEBOOKS for name, default in notebook_parameter_defaults(notebook).items()
    }
    for variable, spec in AMP_VARIABLES.items():
        name = variable.removeprefix(ENV_PREFIX).lower()
        assert name in declared, f"{variable} sets no notebook parameter"
        if name not in AMP_PLATFORM:
            assert yaml.safe_load(spec["default"]) == declared[name], f"{variable} drifted from the notebooks' {name}"
