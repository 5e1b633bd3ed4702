"""A stand-in for CML importing an AMP: `.project-metadata.yaml`'s tasks run in order, each as CML runs it.

CML is not here, so this does on this machine what the AMP specification says each task type does:

- ``run_session``: the script in a fresh Python, working directory the project root (CML's /home/cdsw),
  with the project's environment variables (their defaults, overridden by what the user set at import);
- ``create_job``: the job is recorded (script, arguments, environment), nothing runs;
- ``run_job``: a recorded job's script runs with its arguments and the job's own environment on top;
- ``start_application``: the application is recorded (tests/test_amp.py serves TensorBoard's script itself);
- ``create_model``: the model is recorded with a fresh access key, which CML puts in the project's environment under
  ``access_key_environment_variable``; ``build_model`` records the file and function a replica will call;
- ``deploy_model``: a replica starts as CML's does, importing the built file in a fresh Python with the project's
  environment and the deployment's own; a file that fails to import, or lacks the function, fails the deployment.
  :meth:`AmpImport.call_model` then answers a POST to the endpoint (``{"accessKey", "request"}``) as CML does,
  ``{"success": true, "response": ...}``, running the function in such a replica.

A session or job that exits non-zero ends the import, as it does in CML. The scripts import this checkout's
``textsql`` (``PYTHONPATH``), as the AMP's own ``pip install -e .`` makes them do in CML.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASK_TIMEOUT_S = 600


@dataclass
class TaskRun:
    """One task as the import ran it: exit code and output when something ran (a session or a job)."""

    task: dict[str, Any]
    returncode: int | None = None
    output: str = ""


@dataclass
class AmpImport:
    """A project being imported from its metadata; :meth:`run_all` runs the tasks in order."""

    metadata: dict[str, Any]
    project_dir: Path
    user_environment: Mapping[str, str] = field(default_factory=dict)
    # The session scripts' environment beyond the project's variables (pip's dry run for the install).
    extra_environment: Mapping[str, str] = field(default_factory=dict)
    runs: list[TaskRun] = field(default_factory=list)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    applications: list[dict[str, Any]] = field(default_factory=list)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)

    def environment(self, task_environment: Mapping[str, Any] | None = None) -> dict[str, str]:
        """This machine's environment with the project's variables and a task's own on top."""
        project = {name: spec["default"] for name, spec in self.metadata.get("environment_variables", {}).items()}
        keys = {
            model["task"]["access_key_environment_variable"]: model["access_key"]
            for model in self.models.values()
            if "access_key_environment_variable" in model["task"]
        }
        return {
            **os.environ,
            **project,
            **keys,
            **self.user_environment,
            **self.extra_environment,
            **{key: str(value) for key, value in (task_environment or {}).items()},
            "PYTHONPATH": str(self.project_dir),
        }

    def run_all(self) -> list[TaskRun]:
        """Every task in order until one fails; the runs so far."""
        for task in self.metadata["tasks"]:
            run = self.run(task)
            if run.returncode not in (None, 0):
                break
        return self.runs

    def run(self, task: dict[str, Any]) -> TaskRun:
        """One task, as CML runs its type."""
        kind = task["type"]
        if kind == "run_session":
            run = self._execute(task, task["script"], None, task.get("environment"))
        elif kind == "create_job":
            self.jobs[task["entity_label"]] = task
            run = TaskRun(task)
        elif kind == "run_job":
            job = self.jobs[task["entity_label"]]
            run = self._execute(task, job["script"], job.get("arguments"), job.get("environment"))
        elif kind == "start_application":
            self.applications.append(task)
            run = TaskRun(task)
        elif kind == "create_model":
            self.models[task["entity_label"]] = {"task": task, "access_key": secrets.token_hex(16)}
            run = TaskRun(task)
        elif kind == "build_model":
            self.models[task["entity_label"]]["build"] = task
            run = TaskRun(task)
        elif kind == "deploy_model":
            model = self.models[task["entity_label"]]
            model["deployment"] = task
            replica = self._replica(model, None)
            run = TaskRun(task, replica.returncode, replica.stdout + replica.stderr)
        else:
            raise ValueError(f"task type {kind!r} is not one this emulator knows")
        self.runs.append(run)
        return run

    def call_model(self, entity_label: str, body: dict[str, Any]) -> dict[str, Any]:
        """A POST of ``body`` to a deployed model's endpoint, answered as CML answers it."""
        model = self.models[entity_label]
        if "deployment" not in model:
            raise ValueError(f"model {entity_label!r} is not deployed")
        if body.get("accessKey") != model["access_key"]:
            return {"success": False, "message": "Unauthorized: wrong or missing accessKey"}
        replica = self._replica(model, body["request"])
        if replica.returncode != 0:
            return {"success": False, "message": replica.stderr[-2000:]}
        return {"success": True, "response": json.loads(replica.stdout.strip().splitlines()[-1])}

    def _replica(self, model: dict[str, Any], request: Any) -> subprocess.CompletedProcess:
        """A model replica: the built file imported by its path, its function called with ``request`` when given."""
        build = model["build"]
        code = (
            "import importlib.util, json, sys\n"
            "spec = importlib.util.spec_from_file_location('model', sys.argv[1])\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "function = getattr(module, sys.argv[2])\n"
            "if sys.argv[3] != 'null':\n"
            "    print(json.dumps(function(json.loads(sys.argv[3]))))\n"
        )
        return subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                str(self.project_dir / build["target_file_path"]),
                build["target_function_name"],
                json.dumps(request),
            ],
            check=False,
            cwd=self.project_dir,
            env=self.environment(model["deployment"].get("environment_variables")),
            capture_output=True,
            text=True,
            timeout=TASK_TIMEOUT_S,
        )

    def ran(self) -> list[str]:
        """The scripts that ran, with their arguments, in order."""
        return [
            " ".join(filter(None, (self._script(run.task), self._arguments(run.task))))
            for run in self.runs
            if run.returncode is not None
        ]

    def _execute(
        self, task: dict[str, Any], script: str, arguments: str | None, environment: Mapping | None
    ) -> TaskRun:
        # CML's "None" is the spelling of "no arguments" in Cloudera's own AMPs.
        argv = [] if arguments in (None, "None") else shlex.split(str(arguments))
        result = subprocess.run(
            [sys.executable, str(self.project_dir / script), *argv],
            check=False,
            cwd=self.project_dir,
            env=self.environment(environment),
            capture_output=True,
            text=True,
            timeout=TASK_TIMEOUT_S,
        )
        return TaskRun(task, result.returncode, result.stdout + result.stderr)

    def _script(self, task: dict[str, Any]) -> str:
        if task["type"] == "deploy_model":
            return self.models[task["entity_label"]]["build"]["target_file_path"]
        return task.get("script") or self.jobs[task["entity_label"]]["script"]

    def _arguments(self, task: dict[str, Any]) -> str:
        arguments = task.get("arguments") or self.jobs.get(task.get("entity_label"), {}).get("arguments")
        return "" if arguments in (None, "None") else str(arguments)
