"""MLflow tracking: one run per training from the logging rank, its settings and credentials in a 0600 file; what
the launching side writes, what the logging rank reads, what inference and the end of a training log. The runs
against a real `mlflow server` are in test_tracking_server.py.
"""

from __future__ import annotations

import json
import logging
import secrets
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.launch import fake_prepared

from textsql.arguments import train_argv
from textsql.constants import TRACKING_ENV_NAME, TRACKING_ENV_VAR
from textsql.errors import LaunchError
from textsql.json_files import write_json
from textsql.launching.command import LaunchArguments
from textsql.launching.tracking_env import tracking_env, without_tracking
from textsql.launching.training_plan import TrainingPlan
from textsql.planning.train_args import parse_command_line
from textsql.rundir.master_state import master_dir
from textsql.tracking.launch_runs import MLFLOW_RUN_NAME
from textsql.tracking.mlflow_runs import finish_tracking, load_tracking_env, log_evaluation, start_tracking

EXPERIMENT = "textsql-tracking-test"


# ---- the launching side: a 0600 file for one launch, nothing on the runner's environment ---------


@pytest.mark.parametrize("spelling", ["train_argv", "--run_dir", "--run-dir=", "the launch's alone"])
def test_mlflow_variables_go_to_a_private_file_for_the_launch_and_are_gone_after(tmp_path: Path, spelling: str) -> None:
    out, data = tmp_path / "out", fake_prepared(tmp_path / "data")
    token = secrets.token_hex(16)
    environ = {"MLFLOW_TRACKING_URI": "http://10.0.0.5:5000", "MLFLOW_TRACKING_TOKEN": token, "HOME": "/root"}
    train_args = {
        "train_argv": train_argv(data_dir=data, run_dir=out),  # what the demo's first releases launched with
        "--run_dir": ["--data_dir", str(data), "--run_dir", str(out)],
        "--run-dir=": ["--data-dir", str(data), f"--run-dir={out}"],
        "the launch's alone": train_argv(data_dir=data),  # what notebook 02 launches with
    }[spelling]
    arguments = LaunchArguments(run_dir=out, train_args=train_args)
    with tracking_env(arguments, TrainingPlan.read(arguments), environ) as tracked:
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
    arguments = LaunchArguments(run_dir=tmp_path / "out", train_args=train_argv(data_dir=fake_prepared(tmp_path / "d")))
    with tracking_env(arguments, TrainingPlan.read(arguments), {"HOME": "/root"}) as tracked:
        assert tracked is arguments
    assert not (tmp_path / "out").exists()


def test_an_mlflow_variable_given_with_env_is_refused_naming_the_launching_environment(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="set it in the launching environment"):
        LaunchArguments(run_dir=tmp_path, env={"MLFLOW_EXPERIMENT_NAME": "x"})


def test_a_tracking_file_a_hard_kill_left_is_removed_when_the_next_launch_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / TRACKING_ENV_NAME).write_text(json.dumps({"MLFLOW_TRACKING_PASSWORD": "left-by-a-killed-launch"}))
    arguments = LaunchArguments(run_dir=out, train_args=train_argv(data_dir=fake_prepared(tmp_path / "data")))
    with tracking_env(arguments, TrainingPlan.read(arguments), {"HOME": "/root"}) as tracked:
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
    argv = train_argv(data_dir=tmp_path, run_dir=tmp_path / "out", profile="zero0", report_to="tensorboard,mlflow")
    assert parse_command_line(argv)[3]["report_to"] == ["tensorboard", "mlflow"]
    monkeypatch.setitem(sys.modules, "mlflow", None)  # importlib.util.find_spec("mlflow") is None: not installed
    with pytest.raises(LaunchError, match=r"needs the mlflow package .*pip install 'textsql\[tracking\]'"):
        parse_command_line(argv)
    parse_command_line(train_argv(data_dir=tmp_path, run_dir=tmp_path / "out", profile="zero0"))  # tensorboard


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


def test_inference_scores_go_to_the_run_the_master_kept_not_to_one_the_run_directory_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run directory is the workers' to write: a forged ``mlflow_run.json`` there sends no score elsewhere."""
    from mlflow import MlflowClient

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment(EXPERIMENT, (tmp_path / "artifacts").as_uri())
    trained, other = client.create_run(experiment), client.create_run(experiment)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics_file = run_dir / "metrics.json"
    metrics_file.write_text("{}")
    write_json(master_dir(run_dir) / MLFLOW_RUN_NAME, {"run_id": trained.info.run_id, "output_dir": str(run_dir)})
    (run_dir / MLFLOW_RUN_NAME).write_text(json.dumps({"run_id": other.info.run_id}))
    assert log_evaluation(run_dir, "test", {"lf_accuracy": 0.5}, metrics_file)
    assert client.get_run(trained.info.run_id).data.metrics == {"test_lf_accuracy": 0.5}
    assert client.get_run(other.info.run_id).data.metrics == {}
    (master_dir(run_dir) / MLFLOW_RUN_NAME).unlink()  # `textsql train` without a launch: its rank's record
    for forged in (json.dumps({"run_id": "../../etc"}), "[1]", "not json"):
        (run_dir / MLFLOW_RUN_NAME).write_text(forged)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="textsql.tracking.mlflow_runs"):
            assert not log_evaluation(run_dir, "test", {"lf_accuracy": 0.5}, metrics_file)
        assert "holds no MLflow run id" in caplog.text, forged


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


def test_a_rank_imports_deepspeed_without_mlflow_and_can_still_import_mlflow_after():
    """In a fresh interpreter, as a rank starts: DeepSpeed's autotuner finds no MLflow, and MLflow still imports."""
    probe = (
        "import sys, time\n"
        "from textsql.tracking.mlflow_free import import_deepspeed_lean\n"
        "import_deepspeed_lean()\n"
        "import deepspeed.autotuning.autotuner as autotuner\n"
        "assert 'deepspeed' in sys.modules and 'mlflow' not in sys.modules, sorted(sys.modules)\n"
        "assert autotuner.has_mlflow is False\n"
        "import mlflow\n"
        "assert mlflow.MlflowClient\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
