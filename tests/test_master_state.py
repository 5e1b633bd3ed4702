"""The run's master-private directory where the home is shared with the workers (issue 55, finding 6).

On CML the home directory is the project, which every worker engine mounts read-write as the same user; on a
cluster whose homes are on NFS or Lustre every job's node mounts it. There the default (``~/.local/state``)
could be written by a worker, whose records the master would trust: ``launch_hosts`` (whose step lines the
progress bars believe), the launch ids a continuation ends, ``pipeline.json``, ``.deepspeed_env``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from textsql.rundir.master_state import (
    STATE_DIR_VAR,
    launch_hosts,
    master_dir,
    network_filesystem,
    record_launch_hosts,
)
from worker.files import UnsafePath

# A worker engine's code: it writes the hosts record where the master kept it by default, in the shared home.
FORGE = """
import hashlib, os, pathlib
run = pathlib.Path(os.environ["FORGED_RUN_DIR"]).resolve()
name = f"{run.name}-{hashlib.sha256(str(run).encode()).hexdigest()[:16]}"
state = pathlib.Path.home() / ".local" / "state" / "textsql" / "runs" / name
state.mkdir(parents=True, exist_ok=True)
(state / "launch_hosts").write_text("10.6.6.6\\n")
"""


@pytest.fixture
def cml_session(tmp_path, monkeypatch):
    """A CML session as the master sees it: the home is the project (every engine mounts it), the temporary
    directory the session engine's own disk. Yields the project directory."""
    project, session_disk = tmp_path / "project", tmp_path / "session-disk"
    project.mkdir()
    session_disk.mkdir()
    monkeypatch.delenv(STATE_DIR_VAR, raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(project))
    monkeypatch.setenv("CDSW_ENGINE_ID", "session-engine")
    monkeypatch.setattr(tempfile, "tempdir", str(session_disk))
    return project


@pytest.mark.slow
def test_on_cml_a_worker_writing_the_shared_home_cannot_speak_for_the_master(cml_session, cml_emulator):
    run_dir = cml_session / "runs" / "r1"
    record_launch_hosts(run_dir, ["10.0.0.5", "10.0.0.6"])  # the master's own launch: rank 0 on 10.0.0.5
    engines = cml_emulator.launch_workers(
        n=1, cpu=1, memory=1, code=FORGE, env={"HOME": str(cml_session), "FORGED_RUN_DIR": str(run_dir)}
    )
    done = cml_emulator.await_workers(engines, wait_for_completion=True, timeout_seconds=60)
    assert [engine["status"] for engine in done["workers"]] == ["succeeded"], done
    forged = next((cml_session / ".local" / "state" / "textsql" / "runs").iterdir()) / "launch_hosts"
    assert forged.read_text() == "10.6.6.6\n", "the worker wrote the shared home"
    assert launch_hosts(run_dir) == ["10.0.0.5", "10.0.0.6"], "the master believed the worker's record"
    private = master_dir(run_dir)
    assert not private.is_relative_to(cml_session) and oct(private.stat().st_mode & 0o777) == "0o700"


def test_a_state_dir_the_user_chose_is_kept_even_in_a_shared_home(cml_session, monkeypatch):
    """TEXTSQL_STATE_DIR is the user's decision (continuing a pipeline from another session, knowingly)."""
    chosen = cml_session / "state"
    monkeypatch.setenv(STATE_DIR_VAR, str(chosen))
    assert master_dir(cml_session / "runs" / "r1").is_relative_to(chosen)


def test_where_the_private_fallback_is_shared_too_the_error_names_the_fix(cml_session, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(cml_session / "tmp"))
    with pytest.raises(UnsafePath, match=rf"^.*shared with the workers.*; set {STATE_DIR_VAR} to a directory on"):
        master_dir(cml_session / "runs" / "r1")


def test_a_home_on_a_network_filesystem_is_told_from_a_local_one():
    """The mount table as Linux writes it (/proc/self/mounts): the longest mount point above a path decides."""
    mounts = (
        "/dev/sda1 / ext4 rw,relatime 0 0\n"
        "filer:/export/home /home nfs4 rw,relatime,vers=4.2 0 0\n"
        "tmpfs /home/alice/.cache tmpfs rw 0 0\n"
        "lustre@o2ib:/scratch /scratch\\040space lustre rw 0 0\n"
    )
    assert network_filesystem(Path("/home/alice/.local/state/textsql"), mounts) == "nfs4"
    assert network_filesystem(Path("/home/alice/.cache/x"), mounts) is None
    assert network_filesystem(Path("/scratch space/runs"), mounts) == "lustre"
    assert network_filesystem(Path("/homework"), mounts) is None
    assert network_filesystem(Path("/tmp/x"), mounts) is None
