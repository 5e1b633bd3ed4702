"""The run's master-private directory: what the master writes and later trusts, where no worker writes, and the
hosts of the latest launch it keeps there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from worker.files import UnsafePath, atomic_write, private_dir

# Where the master-private directories live (default: $XDG_STATE_HOME/textsql), and the latest launch's hosts there.
STATE_DIR_VAR = "TEXTSQL_STATE_DIR"
LAUNCH_HOSTS_NAME = "launch_hosts"


def master_dir(run_dir: str | Path) -> Path:
    """The run's master-private directory: what the master writes and later trusts, where no worker writes.

    The run directory is shared with the workers on Kubernetes and CML (a project volume) and with hosts that mount
    it over NFS, so the master's own records live apart, 0700, on the master's disk: under ``$TEXTSQL_STATE_DIR``,
    else ``$XDG_STATE_HOME/textsql`` (``~/.local/state/textsql``), one directory per run directory, named after it
    and a hash of its resolved path.

    :param run_dir: the run directory.
    :rtype: pathlib.Path
    :raises UnsafePath: if the directory (or its root) is a link or another user's, or lies inside the run directory.
    """
    run = Path(run_dir).resolve()
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "textsql"
    root = Path(os.environ.get(STATE_DIR_VAR) or state).absolute()
    if root.resolve().is_relative_to(run):
        raise UnsafePath(
            f"{STATE_DIR_VAR}={str(root)!r} lies in the run directory the workers may write; set it elsewhere"
        )
    directory = root / "runs" / f"{run.name}-{hashlib.sha256(str(run).encode()).hexdigest()[:16]}"
    for path in (private_dir(root), private_dir(directory)):
        if path.lstat().st_uid != os.getuid():
            raise UnsafePath(f"{str(path)!r} belongs to another user; set {STATE_DIR_VAR} to a directory of your own")
    return directory


def record_launch_hosts(run_dir: str | Path, hosts: Iterable[str]) -> None:
    """Keep a launch's hosts, in the hostfile's order (rank 0's first; none for the local launcher), in the run's
    master-private directory before its runner starts: the displays believe step lines from the first one only.

    :param run_dir: the run directory.
    :param hosts: the launch's hosts.
    """
    atomic_write(master_dir(run_dir) / LAUNCH_HOSTS_NAME, "".join(f"{host}\n" for host in hosts), mode=0o600)


def launch_hosts(run_dir: str | Path) -> list[str]:
    """The hosts of the run's latest launch, rank 0's first (:func:`record_launch_hosts`); none before its first
    launch and for the local launcher, whose lines carry no host's prefix.

    :param run_dir: the run directory.
    :rtype: list[str]
    """
    path = master_dir(run_dir) / LAUNCH_HOSTS_NAME
    return path.read_text(encoding="utf-8").split() if path.is_file() else []
