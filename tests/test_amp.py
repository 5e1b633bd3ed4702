"""`.project-metadata.yaml` imports into CML as an AMP: structure, referenced files, job chain, env variables."""
from __future__ import annotations

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

from textsql.demo import ENV_PREFIX, NOTEBOOKS, notebook_path, parameters_from_environ
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
}
RESOURCE_KEYS = ("cpu", "memory", "gpu")


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
        for key in RESOURCE_KEYS:
            assert isinstance(task.get(key, 0), int) and task.get(key, 0) >= 0
        if "script" in task:
            assert (PROJECT_DIR / task["script"]).is_file(), task["script"]
        if task["type"] == "create_job" and task["script"] == "cml/run_notebook.py":
            assert notebook_path(task["arguments"]).is_file()
    assert TASKS[0]["type"] == "run_session" and "install" in TASKS[0]["script"]


def test_jobs_run_once_each_in_the_notebooks_order():
    created: dict[str, str] = {}
    ran = []
    for task in TASKS:
        if task["type"] == "create_job":
            assert task["entity_label"] not in created, "duplicate entity_label"
            created[task["entity_label"]] = task["arguments"]
        if task["type"] == "run_job":
            assert task["entity_label"] in created, f"run_job {task['entity_label']!r} before its create_job"
            ran.append(created[task["entity_label"]])
    assert ran == list(NOTEBOOKS), "each job consumes the previous one's output: 01 -> 02 -> 03"


def test_application_is_tensorboard_on_a_valid_subdomain():
    (application,) = [task for task in TASKS if task["type"] == "start_application"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", application["subdomain"])
    assert "tensorboard" in (PROJECT_DIR / application["script"]).read_text()


def test_job_parameters_come_from_the_environment():
    environ = {"TEXTSQL_WORKERS": "3", "TEXTSQL_PROFILE": "zero3", "TEXTSQL_BACKEND": "cml", "TEXTSQL_NOT_A_PARAMETER": "1"}
    assert parameters_from_environ("02_train_distributed", environ) == {"workers": 3, "profile": "zero3", "backend": "cml"}


@pytest.mark.slow
def test_tensorboard_application_script_serves_on_the_application_port(tmp_path):
    port = free_port()
    env = {**os.environ, "CDSW_APP_PORT": str(port), "TEXTSQL_TENSORBOARD_LOGDIR": str(tmp_path)}
    process = subprocess.Popen([sys.executable, str(PROJECT_DIR / "cml" / "launch_tensorboard.py")], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
