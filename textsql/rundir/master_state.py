"""The run's master-private directory: what the master writes and later trusts, where no worker writes, and the
hosts of the latest launch it keeps there.

Its default lies on this machine's own disk where the home directory is shared with the workers: on CML the home
is the project, which every worker engine mounts read-write as the same user, and a cluster's home on NFS or
Lustre is mounted by every node its jobs run on. There a worker could write the master's records, and the
owner and mode checks cannot tell it from the master (the same user).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

from worker.files import UnsafePath, atomic_write, private_dir

logger = logging.getLogger(__name__)

# Where the master-private directories live (default: $XDG_STATE_HOME/textsql), and the latest launch's hosts there.
STATE_DIR_VAR = "TEXTSQL_STATE_DIR"
LAUNCH_HOSTS_NAME = "launch_hosts"
# Set in every CML engine, the session's included: there the home directory is the project, which every worker
# engine mounts read-write.
CML_ENGINE_VAR = "CDSW_ENGINE_ID"
# Filesystems other machines mount too (Linux's names in /proc/self/mounts): a home on one is every node's.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "afs", "9p",
        "panfs", "wekafs", "fuse.glusterfs", "fuse.sshfs", "fuse.ceph", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse",
    }
)  # fmt: skip
# The state roots already reported as moved off a shared home: said once per process, not at every record.
_reported: set[Path] = set()


def network_filesystem(path: Path, mounts: str | None = None) -> str | None:
    """The type of the network filesystem ``path`` lies on (``nfs4``, ``lustre``, ...), or None for this machine's
    own disk (or where the mount table cannot be read).

    :param path: a path, existing or not (its links are resolved as far as it exists).
    :param mounts: the mount table in ``/proc/self/mounts``' format (default: that file).
    :rtype: str | None
    """
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    target = Path(os.path.realpath(path))
    best: tuple[int, str] = (-1, "")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # The table writes a space in a mount point as \040 (and a tab, newline, backslash likewise, in octal).
        mount_point = Path(re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), fields[1]))
        if target.is_relative_to(mount_point) and len(mount_point.parts) >= best[0]:
            best = (len(mount_point.parts), fields[2])  # the later of two mounts on one point is the one in use
    return best[1] if best[1] in NETWORK_FILESYSTEMS else None


def shared_with_workers(path: Path) -> str | None:
    """Why workers may write ``path``, or None where it is this machine's own.

    :param path: a directory the master would keep its records in.
    :rtype: str | None
    """
    in_home = Path(os.path.realpath(path)).is_relative_to(os.path.realpath(Path.home()))
    if os.environ.get(CML_ENGINE_VAR) and in_home:
        return "on CML the home directory is the project, which every worker engine mounts read-write"
    filesystem = network_filesystem(path)
    if filesystem is not None:
        return f"it lies on a {filesystem} filesystem, which the workers' nodes may mount too"
    return None


def state_root() -> Path:
    """Where the master-private directories live: ``$TEXTSQL_STATE_DIR`` (the user's choice, taken as given), else
    ``$XDG_STATE_HOME/textsql`` (``~/.local/state/textsql``) unless the workers may write it (:func:`shared_with_workers`),
    else ``textsql-state-UID`` in this machine's temporary directory.

    :rtype: pathlib.Path
    :raises UnsafePath: where the home and the temporary directory are both shared with the workers.
    """
    chosen = os.environ.get(STATE_DIR_VAR)
    if chosen:
        return Path(chosen).absolute()
    home_state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state").absolute() / "textsql"
    shared = shared_with_workers(home_state)
    if shared is None:
        return home_state
    private = Path(tempfile.gettempdir()).absolute() / f"textsql-state-{os.getuid()}"
    if shared_with_workers(private) is not None:
        raise UnsafePath(
            f"{str(home_state)!r} and {str(private)!r} are both shared with the workers ({shared}); set "
            f"{STATE_DIR_VAR} to a directory on this machine's own disk"
        )
    if private not in _reported:
        _reported.add(private)
        logger.info("the master's records go to %s, not %s: %s", private, home_state, shared)
    return private


def master_dir(run_dir: str | Path) -> Path:
    """The run's master-private directory: what the master writes and later trusts, where no worker writes.

    The run directory is shared with the workers on Kubernetes and CML (a project volume) and with hosts that mount
    it over NFS, so the master's own records live apart, 0700, on the master's disk: under :func:`state_root`, one
    directory per run directory, named after it and a hash of its resolved path.

    :param run_dir: the run directory.
    :rtype: pathlib.Path
    :raises UnsafePath: if the directory (or its root) is a link or another user's, or lies inside the run directory.
    """
    run = Path(run_dir).resolve()
    root = state_root()
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
