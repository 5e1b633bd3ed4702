"""MLflow tracking: one run per training from the logging rank, its settings and credentials in a 0600 file.

The slow test runs a real `mlflow server` (SQLite store, artifacts served from a directory) behind a proxy that
refuses any request without the run's bearer token, and a real two-host `textsql launch` over pdsh to the two
`local` worker pods: the MLflow run appears once with params, metrics and artifacts (so the token reached the
logging rank), while no process's command line, log or file of the run holds the token.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import os
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.launch import textsql_launch
from helpers.paths import PROJECT_DIR

from bench.tiny_run import tiny_run_argv
from textsql.arguments import train_argv
from textsql.constants import MLFLOW_RUN_NAME, TRACKING_ENV_NAME, TRACKING_ENV_VAR
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.tracking_env import tracking_env, without_tracking
from textsql.tracking.mlflow_runs import finish_tracking, load_tracking_env, log_evaluation, start_tracking
from textsql.training.command_line import parse_command_line
from worker.network import free_port

SERVER_START_S = 180
EXPERIMENT = "textsql-tracking-test"


# ---- the launching side: a 0600 file for one launch, nothing on the runner's environment ---------


@pytest.mark.parametrize("spelling", ["train_argv", "--output_dir", "--output-dir="])
def test_mlflow_variables_go_to_a_private_file_for_the_launch_and_are_gone_after(tmp_path: Path, spelling: str) -> None:
    out = tmp_path / "out"
    token = secrets.token_hex(16)
    environ = {"MLFLOW_TRACKING_URI": "http://10.0.0.5:5000", "MLFLOW_TRACKING_TOKEN": token, "HOME": "/root"}
    train_args = {
        "train_argv": train_argv(data_dir=tmp_path, output_dir=out),  # what notebook 02 and the demo launch with
        "--output_dir": ["--output_dir", str(out)],
        "--output-dir=": [f"--output-dir={out}"],
    }[spelling]
    arguments = LaunchArguments(run_dir=tmp_path / "run", train_args=train_args)
    with tracking_env(arguments, environ) as tracked:
        path = Path(tracked.env[TRACKING_ENV_VAR])
        assert path == (out / TRACKING_ENV_NAME).resolve()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert json.loads(path.read_text()) == {
            "MLFLOW_TRACKING_URI": "http://10.0.0.5:5000",
            "MLFLOW_TRACKING_TOKEN": token,
        }
        # Only the path travels with the ranks' variables (.deepspeed_env, pdsh's command line).
        assert token not in json.dumps(tracked.env)
    assert not path.exists()
    assert without_tracking(environ) == {"HOME": "/root"}


def test_without_mlflow_variables_the_launch_is_unchanged(tmp_path: Path) -> None:
    arguments = LaunchArguments(run_dir=tmp_path, train_args=["--output_dir", str(tmp_path / "out")])
    with tracking_env(arguments, {"HOME": "/root"}) as tracked:
        assert tracked is arguments
    assert not (tmp_path / "out").exists()


def test_an_mlflow_variable_given_with_env_is_refused_naming_the_launching_environment(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="set it in the launching environment"):
        LaunchArguments(run_dir=tmp_path, env={"MLFLOW_EXPERIMENT_NAME": "x"})


def test_a_tracking_file_a_hard_kill_left_is_removed_when_the_next_launch_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / TRACKING_ENV_NAME).write_text(json.dumps({"MLFLOW_TRACKING_PASSWORD": "left-by-a-killed-launch"}))
    arguments = LaunchArguments(run_dir=tmp_path, train_args=["--output_dir", str(out)])
    with tracking_env(arguments, {"HOME": "/root"}) as tracked:
        assert tracked is arguments and not (out / TRACKING_ENV_NAME).exists()


# ---- the logging rank ------------------------------------------------------------------------------


def test_the_logging_rank_reads_the_file_keeping_its_hosts_own_values(tmp_path: Path) -> None:
    path = tmp_path / TRACKING_ENV_NAME
    path.write_text(json.dumps({"MLFLOW_TRACKING_URI": "http://master", "MLFLOW_TRACKING_TOKEN": "t"}))
    environ = {TRACKING_ENV_VAR: str(path), "MLFLOW_TRACKING_URI": "http://the-hosts-own"}
    assert load_tracking_env(environ) == ["MLFLOW_TRACKING_TOKEN"]
    assert environ["MLFLOW_TRACKING_URI"] == "http://the-hosts-own" and environ["MLFLOW_TRACKING_TOKEN"] == "t"
    # A host that cannot see the output directory keeps its own settings.
    assert load_tracking_env({TRACKING_ENV_VAR: str(tmp_path / "absent")}) == []


def test_report_to_mlflow_without_the_package_is_refused_in_one_line_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = train_argv(data_dir=tmp_path, output_dir=tmp_path / "out", profile="zero0", report_to="tensorboard,mlflow")
    assert parse_command_line(argv)[3]["report_to"] == ["tensorboard", "mlflow"]
    monkeypatch.setitem(sys.modules, "mlflow", None)  # importlib.util.find_spec("mlflow") is None: not installed
    with pytest.raises(LaunchError, match=r"needs the mlflow package .*pip install 'textsql\[tracking\]'"):
        parse_command_line(argv)
    parse_command_line(train_argv(data_dir=tmp_path, output_dir=tmp_path / "out", profile="zero0"))  # tensorboard


def test_inference_scores_join_the_training_run_and_a_tracking_failure_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow import MlflowClient

    caplog.set_level(logging.WARNING, logger="textsql.tracking.mlflow_runs")  # whatever an earlier test left it at
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    client = MlflowClient(tracking_uri)
    run = client.create_run(client.create_experiment(EXPERIMENT, (tmp_path / "artifacts").as_uri()))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics_file = run_dir / "metrics.json"
    metrics_file.write_text("{}")
    assert not log_evaluation(run_dir, "test", {"lf_accuracy": 0.5}, metrics_file)  # a run not tracked: nothing
    (run_dir / MLFLOW_RUN_NAME).write_text(json.dumps({"run_id": run.info.run_id}))
    scores = {"lf_accuracy": 0.5, "ex_accuracy": 0.75, "n": 8, "per_agg": {"": 0.5}}
    assert log_evaluation(run_dir, "test", scores, metrics_file)
    logged = client.get_run(run.info.run_id).data.metrics
    assert logged == {"test_lf_accuracy": 0.5, "test_ex_accuracy": 0.75, "test_n": 8.0}
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id, "test")] == ["test/metrics.json"]
    (run_dir / MLFLOW_RUN_NAME).write_text(json.dumps({"run_id": "0" * 32}))  # a run this server does not know
    assert not log_evaluation(run_dir, "test", scores, metrics_file)
    assert "the scores were not logged to MLflow run" in caplog.text


def logging_rank(output: Path) -> SimpleNamespace:
    """What start_tracking and finish_tracking read of a trainer: its arguments and whether it logs."""
    return SimpleNamespace(
        args=SimpleNamespace(report_to=["mlflow"], output_dir=str(output)), is_world_process_zero=lambda: True
    )


@pytest.fixture
def local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A local MLflow store (SQLite) in the environment, its experiment's artifacts under tmp_path; yields a client."""
    import mlflow
    from mlflow import MlflowClient

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
    client = MlflowClient(tracking_uri)
    client.create_experiment(EXPERIMENT, (tmp_path / "artifacts").as_uri())
    yield client
    while mlflow.active_run() is not None:
        mlflow.end_run()


def test_the_end_of_a_training_uploads_no_metrics_json_an_earlier_model_left(
    local_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.json").write_text(json.dumps({"lf_accuracy": 0.9}))  # the previous model's scores
    (out / "run.json").write_text("{}")
    trainer = logging_rank(out)
    monkeypatch.setattr("atexit.register", lambda *args: None)  # the test ends the run itself
    run_id = start_tracking(trainer, {"model": "default"}, resumed=False)
    finish_tracking(trainer)
    assert local_store.get_run(run_id).info.status == "FINISHED"
    assert [artifact.path for artifact in local_store.list_artifacts(run_id)] == ["run.json"]


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


@pytest.fixture
def mlflow_server(tmp_path: Path):
    """`mlflow server` on 127.0.0.1 with a SQLite store and served artifacts; yields its port."""
    port = free_port()
    with open(tmp_path / "mlflow-server.log", "w") as log:
        server = subprocess.Popen(
            [
                *(sys.executable, "-m", "mlflow", "server", "--workers", "1"),
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"),
                *("--artifacts-destination", str(tmp_path / "mlflow-artifacts")),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + SERVER_START_S
            while True:
                assert server.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow server did not answer /health"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    time.sleep(1)
            yield port
        finally:
            os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its uvicorn worker
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:  # uvicorn's graceful shutdown can outlast a loaded machine
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


class CommandLines:
    """Every process command line that holds ``secret``, looked at every 0.2 s until stopped."""

    def __init__(self, secret: str, private_file: Path) -> None:
        self.secret, self.private_file = secret.encode(), private_file
        self.holding: list[str] = []
        self.private_file_modes: set[int] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.wait(0.2):
            for entry in Path("/proc").iterdir():
                try:
                    command = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if self.secret in command:
                    self.holding.append(command.replace(b"\0", b" ").decode(errors="replace"))
            try:
                self.private_file_modes.add(stat.S_IMODE(self.private_file.stat().st_mode))
            except FileNotFoundError:
                pass


@pytest.mark.slow
def test_a_two_host_run_logs_one_mlflow_run_and_its_token_is_on_no_command_line_log_or_file(
    two_local_workers, prepared_sample: Path, mlflow_server: int, tmp_path: Path
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
        "MLFLOW_EXPERIMENT_NAME": EXPERIMENT,
        "MLFLOW_TRACKING_TOKEN": token,
        "OMP_NUM_THREADS": "1",
    }
    watch = CommandLines(token, out / TRACKING_ENV_NAME)
    watch.thread.start()
    try:
        result = subprocess.run(
            [*textsql_launch(run_dir), "--", *train_args],
            check=False,
            env=environ,
            cwd=PROJECT_DIR,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        watch.stop.set()
        watch.thread.join()
        proxy.shutdown()
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]

    client = MlflowClient(f"http://127.0.0.1:{mlflow_server}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, f"nothing was logged to the server: {output[-6000:]}"
    runs = client.search_runs([experiment.experiment_id])
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
    textsql_train(prepared_sample, out, tracking_uri, max_steps=4, resume="auto")

    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "1"
    assert [point.step for point in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]


def test_a_tracking_failure_shows_no_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow's exception text names the tracking URI, user and password included: the warning masks it."""
    from mlflow.exceptions import MlflowException

    class RefusingClient:
        def log_metric(self, *args: object) -> None:
            raise MlflowException("API request to http://alice:s3cr@t@mlflow:5000/api/2.0/runs failed")

    monkeypatch.setattr("mlflow.MlflowClient", RefusingClient)
    caplog.set_level(logging.WARNING, logger="textsql.tracking.mlflow_runs")
    (tmp_path / MLFLOW_RUN_NAME).write_text(json.dumps({"run_id": "0" * 32}))
    assert not log_evaluation(tmp_path, "test", {"lf_accuracy": 0.5}, tmp_path / "metrics.json")
    assert "http://alice:***@mlflow:5000" in caplog.text and "s3cr" not in caplog.text


def test_the_logging_rank_takes_only_mlflow_variables_from_the_file(tmp_path: Path) -> None:
    """The file lies in the output directory: one a worker swapped could otherwise set LD_PRELOAD for rank 0."""
    path = tmp_path / TRACKING_ENV_NAME
    path.write_text(json.dumps({"MLFLOW_TRACKING_URI": "http://master", "LD_PRELOAD": "/tmp/evil.so", "PATH": "/x"}))
    environ = {TRACKING_ENV_VAR: str(path)}
    assert load_tracking_env(environ) == ["MLFLOW_TRACKING_URI"]
    assert "LD_PRELOAD" not in environ and "PATH" not in environ


@pytest.mark.parametrize("content", [None, "not json", "[1, 2]"])
def test_a_tracking_file_the_rank_cannot_read_is_a_warning(
    tmp_path: Path, content: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Master and pods may run as different users (a 0600 file of another uid), or the file may be damaged."""
    path = tmp_path / TRACKING_ENV_NAME
    if content is None:
        path.mkdir()  # reading a directory fails as an unreadable file does, even as root
    else:
        path.write_text(content)
    caplog.set_level(logging.WARNING, logger="textsql.tracking.mlflow_runs")
    assert load_tracking_env({TRACKING_ENV_VAR: str(path)}) == []
    assert "MLflow uses this host's own settings" in caplog.text
