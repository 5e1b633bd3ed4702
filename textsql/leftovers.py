"""What a hard-killed run of the notebooks left running on this machine, found and ended before a resume.

SIGKILL of a demo's process group ends papermill, but not what runs in sessions of its own: the notebook kernel
(jupyter_client starts it in a new session; it exits a second after it sees its parent gone, leaving its children),
the local workers' agents and their sshd (they give up 15 s after the master is gone), DeepSpeed's runner with
pdsh and its ssh clients (a session of their own: :mod:`textsql.launching.launch`), and the ranks under each
worker's sshd, which may go on training and writing checkpoints into the run directory the resume continues.

They are found by markers, never by name: the attempt's id (:data:`textsql.notebook_manifest.ATTEMPT_VAR`), which
every process the attempt started inherits, and each launch's id (:data:`textsql.launching.ranks.LAUNCH_ID_VAR`,
recorded in ``launch.log``), which its ranks carry. Each gets SIGTERM, then SIGKILL after a grace.
Once they are gone their ports (sshd, the rendezvous, torch's store) are closed; the resume picks its ports
afresh by binding them (:func:`worker.network.free_port_on_all`), never by reusing the killed run's.

Workers on other machines (cml, kubernetes) are not reached from here: an agent whose master is gone stops its sshd
and exits, which ends its pod and the ranks in it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from textsql.constants import LAUNCH_LOG_NAME
from textsql.launching.ranks import END_GRACE_S, end_marked
from textsql.notebook_manifest import ATTEMPT_VAR

logger = logging.getLogger(__name__)

# The line textsql.launching.launch writes to launch.log as each launch starts: "# DATE TIME launch ID: COMMAND".
LAUNCH_LINE = re.compile(r"^# \S+ \S+ launch (?P<id>[0-9a-f]+): ", re.MULTILINE)


def launch_ids(run_dir: Path) -> list[str]:
    """The ids of every launch recorded in the run's ``launch.log``, oldest first.

    :param run_dir: the run directory.
    :rtype: list[str]
    """
    log = run_dir / LAUNCH_LOG_NAME
    if not log.is_file():
        return []
    text = log.read_text(encoding="utf-8", errors="replace")
    return list(dict.fromkeys(match["id"] for match in LAUNCH_LINE.finditer(text)))


def end_leftovers(run_dir: Path, attempt: str | None, grace: float = END_GRACE_S) -> int:
    """End this machine's processes of an earlier attempt in ``run_dir``: those carrying its id, and the ranks of
    every launch in its ``launch.log``.

    :param run_dir: the run directory.
    :param attempt: the earlier attempt's id (``None``: none recorded, only the ranks are looked for).
    :param grace: seconds between SIGTERM and SIGKILL.
    :rtype: int
    :returns: how many processes were ended.
    """
    ended = end_marked(attempt, grace, variable=ATTEMPT_VAR) if attempt else 0
    for launch in launch_ids(run_dir):
        ended += end_marked(launch, grace)
    if ended:
        logger.warning("ended %d processes left running by the earlier run in %s", ended, run_dir)
    return ended
