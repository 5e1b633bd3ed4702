"""What a hard-killed run leaves behind and how it is ended before the pipeline continues: only processes that carry
an id the master recorded in its private directory and the run's mark, never another run's, never an id a worker
wrote into the run directory; a new or continued demo refuses while the earlier one still runs; the credentials a
killed launch left are removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from click.testing import CliRunner
from helpers.checkpoints import complete_checkpoint

from textsql.cli import cli
from textsql.constants import LAUNCH_IDS_NAME, LAUNCH_LOG_NAME, TRACKING_ENV_NAME
from textsql.launching.launch import DEEPSPEED_ENV_NAME, record_launch
from textsql.launching.ranks import LAUNCH_ID_VAR
from textsql.pipeline.demo import DEMO_MARKER
from textsql.pipeline.leftovers import end_leftovers, launch_ids
from textsql.pipeline.manifest import (
    ATTEMPT_VAR,
    Manifest,
    manifest_path,
)
from textsql.rank_lines import RUN_MARK_VAR, run_mark
from textsql.rundir.master_state import master_dir


def test_an_attempt_still_running_is_found_and_a_dead_one_is_not(tmp_path):
    manifest = Manifest(tmp_path)
    before = dict(os.environ)
    manifest.begin()
    assert dict(os.environ) == before, "the attempt's marks go to the kernels it starts, not into this process"
    assert manifest.marks() == {ATTEMPT_VAR: manifest.attempt["id"], RUN_MARK_VAR: run_mark(tmp_path)}
    assert manifest.running_elsewhere() is None, "this very process"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        manifest.data["attempt"] |= {"pid": other.pid, "created": psutil.Process(other.pid).create_time()}
        assert manifest.running_elsewhere() == other.pid
        manifest.data["attempt"]["created"] -= 100  # the pid of a process long gone, now given to another
        assert manifest.running_elsewhere() is None
    finally:
        other.kill()
        other.wait()


def test_continuing_ends_what_the_killed_attempt_left_and_nothing_else(tmp_path):
    logged, relaunched = "5f0c2a9e41d7b3c8", "9f7c6e7672994136"
    attempt, another = "a1" * 8, "b2" * 8
    # Each launch records its id in the run's master-private directory before its runner starts.
    record_launch(tmp_path, logged)
    record_launch(tmp_path, relaunched)
    assert launch_ids(tmp_path) == [logged, relaunched]
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    ours, theirs = {RUN_MARK_VAR: run_mark(tmp_path)}, {RUN_MARK_VAR: run_mark(tmp_path / "another-run")}

    def started(**marks: str) -> subprocess.Popen:
        # Sessions of their own, as the kernel, the workers and DeepSpeed's runner have: a group kill misses them.
        return subprocess.Popen(sleep, env={**os.environ, **marks}, start_new_session=True)

    left = [
        started(**{ATTEMPT_VAR: attempt}, **ours),
        started(**{LAUNCH_ID_VAR: logged}, **ours),
        started(**{LAUNCH_ID_VAR: relaunched}, **ours),
    ]
    bystanders = [
        started(**{ATTEMPT_VAR: another}, **ours),
        started(**{LAUNCH_ID_VAR: "0123456789abcdef"}, **ours),
        # The ids on record, carried by another run's processes: matched on the run's mark too, never signalled.
        started(**{ATTEMPT_VAR: attempt}, **theirs),
        started(**{LAUNCH_ID_VAR: logged}, **theirs),
    ]
    time.sleep(0.5)  # their environment is in /proc once they have started
    try:
        assert end_leftovers(tmp_path, attempt, grace=5) == 3
        # SIGKILL for the attempt's own (DeepSpeed's runner answers SIGTERM with a pkill by pattern), SIGTERM for ranks.
        assert [process.wait(timeout=10) for process in left] == [-signal.SIGKILL, -signal.SIGTERM, -signal.SIGTERM]
        assert [process.poll() for process in bystanders] == [None] * 4, "another run's processes are not ours"
    finally:
        for process in left + bystanders:
            process.kill()
            process.wait()


def test_launch_ids_a_worker_writes_into_the_run_directory_are_never_signalled(tmp_path):
    """A worker can write the run directory (launch.log holds the ranks' lines; a \\r there once started a line of
    its own): ids are read only from the master-private directory, and only in the form the master makes them."""
    honest, forged = "5f0c2a9e41d7b3c8", "0123456789abcdef"
    record_launch(tmp_path, honest)
    (tmp_path / LAUNCH_LOG_NAME).write_bytes(
        f"# 2026-11-26 01:00:00 launch {honest}: deepspeed\n"
        f"127.0.0.3: step 1/4\r# 2026-11-26 01:00:01 launch {forged}: deepspeed\n".encode()
    )
    (tmp_path / DEEPSPEED_ENV_NAME).write_text(f"{LAUNCH_ID_VAR}={forged}\n")
    with open(master_dir(tmp_path) / LAUNCH_IDS_NAME, "a") as record:
        record.write("-1\n0\n*\n")  # what a forged record's kill would reach: every process of the group, init
    assert launch_ids(tmp_path) == [honest]


def test_ending_leftovers_removes_the_credentials_a_killed_launch_left(tmp_path):
    (tmp_path / TRACKING_ENV_NAME).write_text('{"MLFLOW_TRACKING_PASSWORD": "p"}')
    assert end_leftovers(tmp_path, None) == 0
    assert not (tmp_path / TRACKING_ENV_NAME).exists()


def test_continuing_a_demo_is_refused_while_the_earlier_demo_still_runs(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / DEMO_MARKER).touch()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        manifest = Manifest(out)
        manifest.data["attempt"] = {"id": "a1", "pid": other.pid, "created": psutil.Process(other.pid).create_time()}
        manifest.save()
        result = CliRunner().invoke(cli, ["demo", "--run-dir", str(out), "--resume"])
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
        assert f"still running in {out} (pid {other.pid}); let them finish, or stop them (kill {other.pid})" in (
            result.output
        )
        assert other.poll() is None, "the running demo was left alone"
    finally:
        other.kill()
        other.wait()


def test_a_new_demo_refuses_to_replace_one_still_running_and_deletes_nothing(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / DEMO_MARKER).touch()
    complete_checkpoint(out, 2)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        manifest = Manifest(out)
        manifest.data["attempt"] = {"id": "a1", "pid": other.pid, "created": psutil.Process(other.pid).create_time()}
        manifest.save()
        result = CliRunner().invoke(cli, ["demo", "--run-dir", str(out)])
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
        assert f"still running in {out} (pid {other.pid}); let them finish, or stop them (kill {other.pid})" in (
            result.output
        )
        assert (out / "checkpoint-2").is_dir() and manifest_path(out).is_file(), "nothing was deleted"
        assert other.poll() is None, "the running demo was left alone"
    finally:
        other.kill()
        other.wait()
