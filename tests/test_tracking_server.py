"""MLflow tracking against a real server: a real `mlflow server` (SQLite store, artifacts served from a directory)
behind a proxy that refuses any request without the run's bearer token, and a real two-host `textsql launch` over
pdsh to the two `local` worker pods: the MLflow run appears once with params, metrics and artifacts (so the token
reached the logging rank), while no process's command line, log or file of the run holds the token; a resumed
training continues its MLflow run.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from helpers.launch import SecretWatch, fake_prepared, on_cluster, tagged_processes, textsql_launch
from helpers.paths import PROJECT_DIR

from bench.tiny_run import tiny_run_argv
from textsql.arguments import train_argv
from textsql.constants import TRACKING_ENV_NAME, TRACKING_ENV_VAR
from textsql.json_files import read_json
from textsql.launching.command import LaunchArguments
from textsql.launching.tracking_env import tracking_env
from textsql.launching.training_plan import TrainingPlan
from textsql.pipeline.leftovers import end_leftovers
from textsql.rundir.master_state import master_dir
from textsql.tracking.launch_runs import MLFLOW_RUN_NAME
from worker.network import free_port

SERVER_START_S = 180
EXPERIMENT = "textsql-tracking-test"


# ---- a real tracking server and a real two-host run ----------------------------------------------------


class BearerProxy(http.server.ThreadingHTTPServer):
    """Forwards to the MLflow server only requests that carry ``Authorization: Bearer <token>``; counts both kinds."""

    daemon_threads = True

    def __init__(self, upstream_port: int, token: str) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream_port, self.token = upstream_port, token
        self.forwarded, self.refused = 0, 0


class _Forward(http.server.BaseHTTPRequestHandler):
    server: BearerProxy

    def forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self.server.refused += 1
            self.send_error(401)
            return
        self.server.forwarded += 1
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        dropped = {"host", "connection", "authorization"}
        upstream.request(
            self.command, self.path, body, {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        )
        response = upstream.getresponse()
        data = response.read()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in {"connection", "transfer-encoding", "content-length"}:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

    def log_message(self, format: str, *args: object) -> None:
        pass


def answers(port: int) -> bool:
    """Whether the MLflow server on ``port`` answers ``/health``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with a SQLite store and served artifacts, started once for the module (about
    6 s here); yields its port. Each test logs to an experiment of its own (:func:`experiment`)."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    with open(root / "mlflow-server.log", "w") as log:
        server = subprocess.Popen(
            [
                *(sys.executable, "-m", "mlflow", "server", "--workers", "1"),
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
                *("--artifacts-destination", str(root / "mlflow-artifacts")),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # MLflow's job runner (GenAI evaluation jobs, unused here) keeps its queue in a /dev/shm directory that
            # the server never removes: one left behind per test otherwise.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        try:
            deadline = time.monotonic() + SERVER_START_S
            while not answers(port):
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        "mlflow_server: `mlflow server` did not answer /health: "
                        + (root / "mlflow-server.log").read_text()[-3000:]
                    )
                time.sleep(1)
            yield port
        finally:
            os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its uvicorn worker
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:  # uvicorn's graceful shutdown can outlast a loaded machine
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


@pytest.fixture
def experiment(mlflow_server: int, request: pytest.FixtureRequest) -> str:
    """A name no run on the module's server has logged to yet, this test's own: the tests count their runs."""
    from mlflow.tracking import MlflowClient

    if not answers(mlflow_server):
        pytest.fail(f"experiment: the module's mlflow server on port {mlflow_server} no longer answers /health")
    name = f"{EXPERIMENT}-{request.node.name}"
    if MlflowClient(f"http://127.0.0.1:{mlflow_server}").get_experiment_by_name(name) is not None:
        pytest.fail(f"experiment: {name!r} already exists on the module's mlflow server")
    return name


@pytest.mark.slow
def test_a_two_host_run_logs_one_mlflow_run_and_its_token_is_on_no_command_line_log_or_file(
    two_local_workers, prepared_sample: Path, mlflow_server: int, experiment: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    token = secrets.token_urlsafe(24)
    proxy = BearerProxy(mlflow_server, token)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    run_dir, out = two_local_workers.run_dir, tmp_path / "out"
    train_args = tiny_run_argv(
        prepared_sample,
        out,
        max_steps=4,
        eval_every=2,
        save_steps=4,
        report_to="tensorboard,mlflow",
        disable_tqdm=None,
    )
    environ = os.environ | {
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{proxy.server_address[1]}",
        "MLFLOW_EXPERIMENT_NAME": experiment,
        "MLFLOW_TRACKING_TOKEN": token,
        "OMP_NUM_THREADS": "1",
    }
    try:
        with SecretWatch(token, out / TRACKING_ENV_NAME) as watch:
            result = subprocess.run(
                [*textsql_launch(out, *on_cluster(run_dir)), "--", *train_args],
                check=False,
                env=environ,
                cwd=PROJECT_DIR,
                capture_output=True,
                text=True,
                timeout=900,
            )
    finally:
        proxy.shutdown()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]

    client = MlflowClient(f"http://127.0.0.1:{mlflow_server}")
    logged = client.get_experiment_by_name(experiment)
    assert logged is not None, f"nothing was logged to the server: {output[-6000:]}"
    runs = client.search_runs([logged.experiment_id])
    assert len(runs) == 1, "one MLflow run per training, not one per rank"
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert json.loads((out / MLFLOW_RUN_NAME).read_text())["run_id"] == run.info.run_id
    params = run.data.params
    assert params["world_size"] == "2" and params["model"] == "default" and params["data_source"] == "sample"
    assert {"profile", "precision", "per_device_train_batch_size", "learning_rate", "max_steps"} <= set(params)
    assert len(params) < 30, "the trainer's own dump of every argument stays off"
    assert [point.step for point in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert {"eval_loss", "eval_lf_accuracy", "eval_parse_rate", "train_loss"} <= set(run.data.metrics)
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"run.json", "all_results.json"} <= artifacts
    # Every request reached the server with the token: the logging rank had it, from the file alone.
    assert proxy.forwarded > 0 and proxy.refused == 0

    assert watch.holding == [], "the tracking token was on a command line"
    assert watch.private_file_modes == {0o600}, "the tracking file was not seen, or not private, during the launch"
    assert not (out / TRACKING_ENV_NAME).exists(), "the tracking file outlived the launch"
    assert token not in output
    for path in [*run_dir.rglob("*"), *out.rglob("*")]:
        if path.is_file():
            assert token.encode() not in path.read_bytes(), f"the tracking token is in {path}"


def textsql_train(
    data: Path, output: Path, tracking_uri: str, max_steps: int, **values: object
) -> subprocess.CompletedProcess:
    """`textsql train` in one process, logging to MLflow with the environment's own variables."""
    arguments = tiny_run_argv(
        data,
        output,
        max_steps=max_steps,
        eval_every=None,
        profile="zero0",
        save_steps=2,
        max_eval_samples=4,
        report_to="mlflow",
        **values,
    )
    environ = os.environ | {
        "MLFLOW_TRACKING_URI": tracking_uri,
        "MLFLOW_EXPERIMENT_NAME": EXPERIMENT,
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [str(Path(sys.executable).with_name("textsql")), "train", *arguments],
        check=False,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result


@pytest.mark.slow
def test_a_resumed_training_continues_its_mlflow_run(prepared_sample: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    tracking_uri, out = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "out"
    client = MlflowClient(tracking_uri)
    # A SQLite store keeps artifacts under ./mlruns unless the experiment says where.
    client.create_experiment(EXPERIMENT, (tmp_path / "artifacts").as_uri())
    textsql_train(prepared_sample, out, tracking_uri, max_steps=2)
    textsql_train(prepared_sample, out, tracking_uri, max_steps=4, resume_from_checkpoint="auto")

    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "1"
    assert [point.step for point in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]


def rank_pids(tag: str) -> list[int]:
    """The training ranks among the processes of a launch tagged ``tag`` (not DeepSpeed's launcher above them)."""
    return [
        pid for pid in tagged_processes(tag) if b"textsql.training.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


@pytest.mark.slow
def test_a_relaunch_before_the_first_checkpoint_continues_the_same_mlflow_run(
    prepared_sample: Path, mlflow_server: int, experiment: str, tmp_path: Path
) -> None:
    """The supervisor relaunches a rank killed before any checkpoint: the training starts over from step 0, and logs
    on into the MLflow run the master opened for it and keeps in its own directory, not into a second one."""
    from mlflow.tracking import MlflowClient

    out, log, tag = tmp_path / "out", tmp_path / "launch.out", uuid.uuid4().hex
    train_args = tiny_run_argv(
        prepared_sample, out, max_steps=12, eval_every=None, profile="zero0", save_steps=1000, report_to="mlflow"
    )
    options = ("--launcher", "local", "--ranks", "1", "--max-restarts", "1")
    uri = f"http://127.0.0.1:{mlflow_server}"
    environ = os.environ | {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": experiment, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as output:
        launch = subprocess.Popen(
            [*textsql_launch(out, *options, env={"LAUNCH_TEST_TAG": tag}), "--", *train_args],
            env=environ,
            cwd=PROJECT_DIR,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 600
        while not re.search(r"step \d+/12: loss ", log.read_text()):
            assert launch.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        for pid in rank_pids(tag):
            os.kill(pid, signal.SIGKILL)
        assert launch.wait(timeout=600) == 0, log.read_text()[-6000:]
    finally:
        if launch.poll() is None:
            launch.kill()
    assert "relaunching" in log.read_text(), "the supervisor did not relaunch"

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["max_steps"] == "12"
    steps = [point.step for point in client.get_metric_history(run.info.run_id, "loss")]
    assert steps.count(1) == 2 and steps[-12:] == list(range(1, 13)), f"both launches' losses in one run: {steps}"
    assert read_json(master_dir(out) / MLFLOW_RUN_NAME)["run_id"] == run.info.run_id


@pytest.mark.slow
def test_a_run_killed_hard_is_marked_killed_when_its_pipeline_continues_and_the_continuation_reopens_it(
    mlflow_server: int, experiment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master opened the run for a launch, then the demo was SIGKILLed: the run stays RUNNING until the
    continuation ends the killed run's leftovers; the resumed launch is handed the same run."""
    from mlflow.tracking import MlflowClient

    uri = f"http://127.0.0.1:{mlflow_server}"
    settings = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": experiment}
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    train_args = train_argv(data_dir=fake_prepared(tmp_path / "data"), report_to="mlflow")
    first = LaunchArguments(run_dir=run_dir, train_args=train_args)
    with tracking_env(first, TrainingPlan.read(first)) as tracked:
        handed = json.loads(Path(tracked.env[TRACKING_ENV_VAR]).read_text())["MLFLOW_RUN_ID"]
        client = MlflowClient(uri)
        assert client.get_run(handed).info.status == "RUNNING"
        # A hard kill: the launch never gets to its end (the tracking file is removed by the next step too).
        end_leftovers(run_dir, None)
        assert client.get_run(handed).info.status == "KILLED"
    resumed = LaunchArguments(run_dir=run_dir, train_args=[*train_args, *train_argv(resume_from_checkpoint="auto")])
    with tracking_env(resumed, TrainingPlan.read(resumed)) as tracked:
        assert json.loads(Path(tracked.env[TRACKING_ENV_VAR]).read_text())["MLFLOW_RUN_ID"] == handed
    fresh = LaunchArguments(run_dir=run_dir, train_args=[*train_args, *train_argv(overwrite_output_dir=True)])
    with tracking_env(fresh, TrainingPlan.read(fresh)) as tracked:
        assert json.loads(Path(tracked.env[TRACKING_ENV_VAR]).read_text())["MLFLOW_RUN_ID"] != handed, "a new training"
    assert len(client.search_runs([client.get_experiment_by_name(experiment).experiment_id])) == 2
