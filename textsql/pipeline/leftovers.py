"""What a hard-killed run of the notebooks left running on this machine, found and ended before the pipeline continues.

SIGKILL of a demo's process group ends papermill, but not what runs in sessions of its own: the notebook kernel
(jupyter_client starts it in a new session; it exits a second after it sees its parent gone, leaving its children),
the local workers' agents and their sshd (they give up 15 s after the master is gone), DeepSpeed's runner with
pdsh and its ssh clients (a session of their own: :mod:`textsql.launching.launch`), and the ranks under each
worker's sshd, which may go on training and writing checkpoints into the run directory the continuation takes up.

They are found by markers, never by name. The attempt's processes carry its id
(:data:`textsql.pipeline.manifest.ATTEMPT_VAR`, inherited from the demo or job): they get SIGKILL at once, the run
being dead already, and because DeepSpeed's pdsh runner answers SIGTERM with ``pkill -f`` on a pattern that matches
every DeepSpeed launch on the hosts with the same world, other runs' included. The ranks, started under each
worker's sshd, carry their launch's id (:data:`textsql.launching.ranks.LAUNCH_ID_VAR`, which each launch records in
the run's master-private directory before its runner starts): they get SIGTERM, which their per-node launcher passes to its own children, then SIGKILL.
Once they are gone their ports (sshd, the rendezvous, torch's store) are closed; the continuation picks its ports
afresh by binding them (:func:`worker.network.free_port_on_all`), never by reusing the killed run's.

The MLflow run the killed training logged into stays RUNNING, its ranks gone without a word: it is marked KILLED
(:func:`textsql.tracking.launch_runs.end_killed_run`); a continuation that resumes the training reopens it.

Workers on other machines (cml, kubernetes) are not reached from here: an agent whose master is gone stops its sshd
and exits, which ends its pod and the ranks in it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from pathlib import Path

from textsql.constants import LAUNCH_IDS_NAME, TRACKING_ENV_NAME
from textsql.launching.ranks import END_GRACE_S, POLL_S, end_marked, marked_processes
from textsql.pipeline.manifest import ATTEMPT_VAR
from textsql.rank_lines import run_mark
from textsql.rundir.master_state import master_dir
from textsql.tracking.launch_runs import end_killed_run

logger = logging.getLogger(__name__)

# The ids the master made (secrets.token_hex(8)): anything else on record is no id of ours, and never signalled.
ID = re.compile(r"[0-9a-f]{16}")


def launch_ids(run_dir: Path) -> list[str]:
    """The ids of the launches recorded for the run, oldest first: read from its master-private directory, where
    no worker writes (``launch.log`` holds the ranks' lines, and is never read for them).

    :param run_dir: the run directory.
    :rtype: list[str]
    """
    path = master_dir(run_dir) / LAUNCH_IDS_NAME
    lines = path.read_text(encoding="ascii", errors="replace").split("\n") if path.is_file() else []
    return list(dict.fromkeys(line for line in lines if ID.fullmatch(line)))


def end_leftovers(run_dir: Path, attempt: str | None, grace: float = END_GRACE_S) -> int:
    """End this machine's processes of an earlier attempt in ``run_dir``: those carrying its id (SIGKILL), then the
    ranks of every launch the run recorded (SIGTERM, SIGKILL after ``grace``); the MLflow credentials file a
    killed launch left is removed, and the MLflow run it left RUNNING marked KILLED.

    :param run_dir: the run directory.
    :param attempt: the earlier attempt's id (``None``: none recorded, only the ranks are looked for).
    :param grace: seconds the ranks get between SIGTERM and SIGKILL.
    :rtype: int
    :returns: how many processes were ended.
    """
    run = run_mark(run_dir)
    ended = _kill_attempt(attempt, run, grace) if attempt and ID.fullmatch(attempt) else 0
    for launch in launch_ids(run_dir):
        ended += end_marked(launch, grace, run=run)
    # The MLflow credentials a killed launch never got to remove (textsql.launching.tracking_env).
    (run_dir / TRACKING_ENV_NAME).unlink(missing_ok=True)
    end_killed_run(run_dir)
    if ended:
        logger.warning("ended %d processes left running by the earlier run in %s", ended, run_dir)
    return ended


def _kill_attempt(attempt: str, run: str, timeout: float) -> int:
    """SIGKILL every process carrying the attempt's id and the run's mark, until none is left (a dying parent may
    start no more)."""
    pids = marked_processes(attempt, ATTEMPT_VAR, run)
    killed = set(pids)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_S)
        pids = marked_processes(attempt, ATTEMPT_VAR, run)
        killed |= set(pids)
    return len(killed)
