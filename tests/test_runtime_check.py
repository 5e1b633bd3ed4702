"""`textsql preflight`: what the runtime lacks for preparing and training, one line each with its fix."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest
import torch
from click.testing import CliRunner

from textsql.cli import cli
from textsql.launching.preflight import PREPARE, TRAIN, check_runtime, missing_for
from textsql.pipeline.parameters import job_parameters
from worker.network import free_port


def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def answering_hub():
    """An HTTP server that answers every request with 404: an answer all the same."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_hub():
    """A port that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def by_name(checks) -> dict:
    return {check.name: check for check in checks}


def test_every_check_is_one_line_and_all_pass_for_the_embedded_default_on_cpu():
    checks = check_runtime(model="default", source="sample", backend="local", worker_gpus=0, hub_url=refused_url())
    assert [check.name for check in checks] == ["pdsh", "ssh", "sshd", "GPUs", "model hub"]
    assert all(check.ok for check in checks), [check.line() for check in checks]
    assert all("\n" not in check.line() for check in checks)
    assert "not needed" in by_name(checks)["model hub"].detail


def test_missing_tools_name_the_custom_runtime_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a runtime without pdsh and ssh on its PATH
    checks = by_name(check_runtime(model="default", source="sample", backend="cml", worker_gpus=0))
    assert (
        checks["pdsh"].ok is False
        and "custom runtime" in checks["pdsh"].detail
        and "apt-get install -y pdsh" in checks["pdsh"].detail
    )
    assert checks["ssh"].ok is False and "openssh-client" in checks["ssh"].detail
    assert {check.name for check in missing_for(checks.values(), [TRAIN])} == {"pdsh", "ssh"}
    assert missing_for(checks.values(), [PREPARE]) == [], "preparing needs neither"


def test_static_hosts_need_no_local_sshd():
    assert by_name(check_runtime("default", "sample", "static", 0))["sshd"].detail.startswith("not needed")


def test_unreachable_hub_is_missing_for_every_stage_whose_model_comes_from_it():
    hub = by_name(
        check_runtime(
            model="t5-small",
            source="sample",
            backend="local",
            worker_gpus=0,
            training_model="default",
            hub_url=refused_url(),
        )
    )["model hub"]
    assert hub.ok is False and hub.needed_by == (PREPARE,)
    assert "unreachable" in hub.detail and 'set model to "default"' in hub.detail
    source = by_name(check_runtime("default", "hub", "local", 0, hub_url=refused_url()))["model hub"]
    assert (
        source.ok is False and "set source to sample" in source.detail and "model" not in source.detail.split(":")[-1]
    )


def test_any_http_answer_counts_as_reachable(answering_hub):
    hub = by_name(check_runtime("t5-small", "sample", "local", 0, hub_url=answering_hub))["model hub"]
    assert hub.ok is True and hub.needed_by == (PREPARE, TRAIN)


def test_a_silent_hub_is_given_up_on_after_the_timeout(silent_hub):
    hub = by_name(check_runtime("t5-small", "sample", "local", 0, hub_url=silent_hub, hub_timeout=0.5))["model hub"]
    assert hub.ok is False and "no answer in 0.5 s" in hub.detail


def test_offline_mode_is_named(monkeypatch, answering_hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = by_name(check_runtime("t5-small", "sample", "local", 0, hub_url=answering_hub))["model hub"]
    assert hub.ok is False and "HF_HUB_OFFLINE" in hub.detail


def test_gpus_asked_for_on_this_machine():
    gpus = by_name(check_runtime("default", "sample", "local", 2))["GPUs"]
    if torch.version.cuda is None:
        assert gpus.ok is False and "CPU build" in gpus.detail and "worker_gpus 0" in gpus.detail
    elif torch.cuda.device_count() == 0:
        assert gpus.ok is False and "no GPU" in gpus.detail
    else:
        assert gpus.ok is True


def test_cli_reports_everything_and_fails_only_for_the_required_stage(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", refused_url())
    runner = CliRunner()
    result = runner.invoke(cli, ["preflight", "-p", "02_train_distributed.model=t5-small"])
    assert result.exit_code == 1
    assert "MISSING  model hub" in result.output
    assert (
        result.output.strip().splitlines()[-1]
        == "Error: this runtime lacks model hub to train; each fix is on its line above"
    )
    result = runner.invoke(cli, ["preflight", "--require", "prepare", "-p", "02_train_distributed.model=t5-small"])
    assert result.exit_code == 0 and "MISSING  model hub" in result.output


def test_cli_reads_the_jobs_environment(monkeypatch):
    monkeypatch.setenv("TEXTSQL_WORKER_GPUS", "3")
    monkeypatch.setenv("TEXTSQL_BACKEND", "static")
    chosen = job_parameters({"01_prepare_dataset": {"limit": 5}})
    assert chosen["02_train_distributed"]["worker_gpus"] == 3 and chosen["02_train_distributed"]["backend"] == "static"
    assert chosen["01_prepare_dataset"]["limit"] == 5 and chosen["01_prepare_dataset"]["source"] == "synthetic"
    result = CliRunner().invoke(cli, ["preflight", "--require", "prepare"])
    assert result.exit_code == 0 and "worker_gpus 3" in result.output and "static hosts" in result.output
