"""`textsql rendezvous serve` and `register` as jobs run them: exit codes, one-line errors, files."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
from click.testing import CliRunner
from helpers.rendezvous import TEXTSQL, serve_command

from textsql.cli import cli
from worker.network import free_port
from worker.rendezvous.token import new_token

pytestmark = pytest.mark.slow


def test_serve_writes_the_hostfile_once_every_worker_registered(tmp_path):
    token_file, hostfile, port = tmp_path / "token", tmp_path / "run" / "hostfile", free_port()
    token = new_token(token_file)
    key_file = tmp_path / "host_key.pub"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "host_key")], check=True)
    serve = subprocess.Popen(
        serve_command(2, port, token_file, hostfile, "--timeout", "60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        runner = CliRunner()
        base = ["rendezvous", "register", "--master", f"127.0.0.1:{port}", "--token-file", str(token_file)]
        first = runner.invoke(
            cli,
            base
            + ["--address", "10.1.0.7", "--slots", "2", "--ssh-port", "2222", "--ssh-host-key-file", str(key_file)],
        )
        assert first.exit_code == 0, first.output
        assert "registered 10.1.0.7" in first.output
        second = runner.invoke(cli, base + ["--address", "10.1.0.5", "--slots", "1"])
        assert second.exit_code == 0, second.output
        out, err = serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert serve.returncode == 0, err
    assert "2 workers registered" in out
    assert hostfile.read_text() == "10.1.0.5 slots=1\n10.1.0.7 slots=2\n"
    key = " ".join(key_file.read_text().split()[:2])
    assert (hostfile.parent / "known_hosts").read_text() == f"[10.1.0.7]:2222 {key}\n"
    assert token not in out + err


def test_register_with_the_wrong_token_exits_1_with_the_masters_reason(tmp_path):
    token_file, wrong, port = tmp_path / "token", tmp_path / "wrong", free_port()
    new_token(token_file)
    new_token(wrong)
    serve = subprocess.Popen(
        serve_command(1, port, token_file, tmp_path / "hostfile", "--timeout", "30"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        result = subprocess.run(
            [
                TEXTSQL,
                "rendezvous",
                "register",
                "--master",
                f"127.0.0.1:{port}",
                "--token-file",
                str(wrong),
                "--address",
                "10.1.0.5",
                "--timeout",
                "30",
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        serve.kill()
        serve.wait()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: master 127.0.0.1:") and "authentication failed" in last
    assert "Traceback" not in result.stderr


def test_serve_timeout_is_one_line_and_writes_nothing(tmp_path):
    started = time.monotonic()
    result = subprocess.run(
        serve_command(3, 0, tmp_path / "token", tmp_path / "hostfile", "--timeout", "1"),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("Error: only 0 of 3 workers registered within 1s")
    assert not (tmp_path / "hostfile").exists()
    assert oct((tmp_path / "token").stat().st_mode & 0o777) == "0o600"  # created for the workers to use
    assert time.monotonic() - started < 30


def test_register_refuses_bad_values_before_connecting(tmp_path):
    new_token(tmp_path / "token")
    result = CliRunner().invoke(
        cli,
        [
            "rendezvous",
            "register",
            "--master",
            "127.0.0.1:1",
            "--token-file",
            str(tmp_path / "token"),
            "--address",
            "10.0.0.300",
        ],
    )
    assert result.exit_code == 1 and "address '10.0.0.300' is not an IP address" in result.output
    result = CliRunner().invoke(
        cli,
        [
            "rendezvous",
            "register",
            "--master",
            "nowhere",
            "--token-file",
            str(tmp_path / "token"),
            "--address",
            "10.0.0.3",
            "--ssh-port",
            "22",
        ],
    )
    assert result.exit_code == 1 and "--ssh-port and --ssh-host-key-file go together" in result.output


def test_serve_listens_on_this_machine_only_unless_told_and_keeps_its_files_private(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="worker")
    hostfile = tmp_path / "run" / "hostfile"
    result = CliRunner().invoke(
        cli,
        serve_command(1, 0, tmp_path / "token", hostfile, "--timeout", "0.2")[1:],
    )
    assert result.exit_code == 1 and "only 0 of 1 workers registered" in result.output
    assert "rendezvous listening on 127.0.0.1:" in caplog.text
    assert oct(hostfile.parent.stat().st_mode & 0o777) == "0o700"
