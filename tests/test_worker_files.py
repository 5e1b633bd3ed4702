"""Files a run writes stay where they are put: planted links are refused, never written through.

Real agents, real sshd: a link planted where a worker's log goes (another user of a shared run dir,
or a worker writing into the shared volume) must not redirect the write or change the target's mode.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from worker import constants as c
from worker.cluster import start_workers
from worker.files import UnsafePath, atomic_write, private_opener
from worker.sshd import Sshd, generate_keypair


@pytest.fixture
def target(tmp_path) -> Path:
    """A file of the user's elsewhere, which a planted link points at."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text("precious\n")
    path.chmod(0o644)
    return path


def untouched(path: Path) -> bool:
    return path.read_text() == "precious\n" and stat.S_IMODE(path.stat().st_mode) == 0o644


@pytest.mark.slow
def test_a_link_planted_as_a_workers_log_is_refused_and_its_target_untouched(tmp_path, target):
    run = tmp_path / "run"
    (run / c.WORKERS_DIR_NAME).mkdir(parents=True)
    (run / c.WORKERS_DIR_NAME / "local-0.log").symlink_to(target)
    with (
        pytest.raises(UnsafePath, match=r"local-0.log: it is a symbolic link; remove it"),
        start_workers("local", 1, run, timeout=60),
    ):
        pass
    assert untouched(target)


@pytest.mark.slow
def test_a_link_planted_as_sshds_log_is_refused_and_its_target_untouched(tmp_path, target):
    public_key = generate_keypair(tmp_path / "client", "test")
    workdir = tmp_path / "sshd"
    workdir.mkdir()
    (workdir / "sshd.log").symlink_to(target)
    with pytest.raises(UnsafePath, match="sshd.log: it is a symbolic link"):
        Sshd(workdir, "127.0.0.2", 2299, public_key).start()
    assert untouched(target)


def test_a_hard_link_planted_as_a_log_is_refused(tmp_path, target):
    log = tmp_path / "launch.log"
    os.link(target, log)
    with pytest.raises(UnsafePath, match="not a regular file with one name"), open(log, "a", opener=private_opener):
        pass
    assert untouched(target)


def test_a_whole_file_write_replaces_a_planted_link_instead_of_following_it(tmp_path, target):
    config = tmp_path / "ssh_config"
    config.symlink_to(target)
    atomic_write(config, "Host x\n", mode=0o600)
    assert not config.is_symlink() and config.read_text() == "Host x\n" and untouched(target)


@pytest.fixture
def linked_parent(tmp_path, target) -> Path:
    """``run/notebooks``, a worker's link to the directory of ``target`` (another project's notebooks)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notebooks").symlink_to(target.parent)
    return run / "notebooks"


def test_a_whole_file_write_into_a_linked_directory_is_refused_and_writes_nothing_there(linked_parent, target):
    with pytest.raises(UnsafePath, match=r"run/notebooks: it is a symbolic link; remove it") as refused:
        atomic_write(linked_parent / target.name, "the executed copy\n")
    assert "\n" not in str(refused.value)
    assert untouched(target) and [path.name for path in target.parent.iterdir()] == [target.name]


def test_a_log_in_a_linked_directory_is_refused_and_writes_nothing_there(linked_parent, target):
    with pytest.raises(UnsafePath, match=r"run/notebooks: it is a symbolic link"):
        open(linked_parent / "demo.log", "a", opener=private_opener).close()
    assert untouched(target) and [path.name for path in target.parent.iterdir()] == [target.name]


@pytest.mark.slow
def test_the_run_dir_is_private_and_its_ssh_files_are_for_the_user_alone(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    with start_workers("local", 1, run, timeout=60) as cluster:
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert stat.S_IMODE((run / c.WORKERS_DIR_NAME).stat().st_mode) == 0o700
        for path in (cluster.hostfile, cluster.known_hosts, cluster.ssh_config, run / c.TOKEN_NAME):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
