"""textsql.launching.ranks: a launch's processes found by their marker and ended, here and through the module
each host runs (`python -m textsql.launching.ranks end`); other processes are left alone."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from textsql.constants import PROJECT_DIR
from textsql.launching.ranks import RemoteRanks, end_marked, marked_processes, remote_end_command
from textsql.rank_lines import LAUNCH_ID_VAR
from worker.ssh import ssh_options

# Reports that it is ready once its SIGTERM handling is in place, then sleeps.
SLEEPER = """
import signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


def start_sleeper(launch_id: str | None, on_sigterm: str = "exit") -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != LAUNCH_ID_VAR}
    if launch_id is not None:
        env[LAUNCH_ID_VAR] = launch_id
    process = subprocess.Popen([sys.executable, "-c", SLEEPER, on_sigterm], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    return process


@pytest.fixture
def sleepers():
    """Start sleepers; whatever a test leaves alive is killed afterwards."""
    started: list[subprocess.Popen] = []

    def start(launch_id: str | None, on_sigterm: str = "exit") -> subprocess.Popen:
        started.append(start_sleeper(launch_id, on_sigterm))
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_end_marked_terminates_this_launch_only(sleepers) -> None:
    launch_id = secrets.token_hex(8)
    ours = [sleepers(launch_id), sleepers(launch_id)]
    other_launch, unmarked = sleepers(secrets.token_hex(8)), sleepers(None)
    assert sorted(marked_processes(launch_id)) == sorted(process.pid for process in ours)

    assert end_marked(launch_id, grace=5) == 2
    assert [process.wait(timeout=5) for process in ours] == [-signal.SIGTERM, -signal.SIGTERM]
    assert other_launch.poll() is None and unmarked.poll() is None
    assert marked_processes(launch_id) == []


def test_a_process_ignoring_sigterm_is_killed_after_the_grace(sleepers) -> None:
    launch_id = secrets.token_hex(8)
    stubborn = sleepers(launch_id, on_sigterm="ignore")
    started = time.monotonic()
    end_marked(launch_id, grace=1)
    assert stubborn.wait(timeout=5) == -signal.SIGKILL
    assert time.monotonic() - started >= 1


def test_the_remote_command_runs_the_module_from_any_directory(sleepers, tmp_path: Path) -> None:
    """What each host runs, through a shell as ssh runs it, from a directory where textsql is not
    importable and with no PYTHONPATH of its own: the command itself must make the module found."""
    launch_id = secrets.token_hex(8)
    command = remote_end_command(launch_id, grace=5)
    # The venv may import another checkout's textsql; the host must run the ranks' own.
    assert shlex.split(command)[:3] == ["env", f"PYTHONPATH={PROJECT_DIR}", sys.executable]
    ours, unmarked = sleepers(launch_id), sleepers(None)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", LAUNCH_ID_VAR)}
    result = subprocess.run(
        ["sh", "-c", command], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert f"ended 1 processes of launch {launch_id}" in result.stderr
    assert ours.wait(timeout=5) == -signal.SIGTERM
    assert unmarked.poll() is None


@pytest.mark.slow
def test_remote_ranks_end_over_ssh(two_local_workers, sleepers) -> None:
    """Over the run's real ssh to both worker hosts (on this machine, so the sleepers are theirs)."""
    launch_id = secrets.token_hex(8)
    ours, unmarked = [sleepers(launch_id), sleepers(launch_id)], sleepers(None)
    RemoteRanks(ssh_options(two_local_workers.ssh_config), two_local_workers.hosts, launch_id).end()
    assert [process.wait(timeout=5) for process in ours] == [-signal.SIGTERM, -signal.SIGTERM]
    assert unmarked.poll() is None
