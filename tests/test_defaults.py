"""One source of a run's defaults: the CLI, notebook 02, the demo and the AMP say the same as textsql.arguments.

A notebook's parameters and the AMP's environment defaults must be literals, so they repeat the values;
these tests fail as soon as a copy drifts from the dataclass fields and TRAINING_DEFAULTS.
"""

from __future__ import annotations

import ast
from pathlib import Path

import papermill
import yaml

from textsql.arguments import notebook_defaults, train_argv
from textsql.jobs import ENV_PREFIX, demo_parameters, notebook_path
from textsql.training.train import parse_command_line

PROJECT_DIR = Path(__file__).resolve().parent.parent
AMP_VARIABLES = yaml.safe_load((PROJECT_DIR / ".project-metadata.yaml").read_text())["environment_variables"]
# Where the AMP differs on purpose: it runs on CML GPU workers with the model hub in reach, not on this
# machine's local CPU pods with the embedded random-weight T5; and its paths are the CML project's.
AMP_PLATFORM = {"backend", "worker_cpu", "worker_memory", "worker_gpus", "model", "data_dir", "run_dir"}
# What the demo changes on purpose: a short, fast-learning schedule that fits a few minutes on two cores.
DEMO_SCHEDULE = {"learning_rate", "max_steps", "eval_steps"}


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
    model_args, _, run_args, training = parse_command_line(train_argv(data_dir=str(tmp_path), output_dir=str(tmp_path)))
    defaults = notebook_defaults()
    assert run_args.auto_profile and model_args.model == defaults["model"]
    assert (
        training["per_device_train_batch_size"],
        training["learning_rate"],
        training["eval_steps"],
        training["save_steps"],
        training["max_steps"],
        run_args.overwrite_output_dir,
    ) == (
        defaults["per_device_batch_size"],
        defaults["learning_rate"],
        defaults["eval_steps"],
        defaults["eval_steps"],
        defaults["max_steps"],
        defaults["overwrite"],
    )


def test_the_amp_environment_defaults_are_notebook_02s():
    declared = notebook_parameter_defaults("02_train_distributed")
    for variable, spec in AMP_VARIABLES.items():
        name = variable.removeprefix(ENV_PREFIX).lower()
        if name in declared and name not in AMP_PLATFORM:
            assert yaml.safe_load(spec["default"]) == declared[name], f"{variable} drifted from notebook 02's {name}"
    assert yaml.safe_load(AMP_VARIABLES["TEXTSQL_PROFILE"]["default"]) == notebook_defaults()["profile"]


def test_the_demo_takes_the_defaults_but_its_schedule(tmp_path):
    training = demo_parameters(tmp_path)["02_train_distributed"]
    assert not (set(training) & set(notebook_defaults())) - DEMO_SCHEDULE, (
        "the demo repeats a default; leave it to notebook 02"
    )
