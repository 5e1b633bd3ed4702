"""Find and end the processes of one launch, on this machine or on every host over ssh.

Every process of a launch carries ``TEXTSQL_LAUNCH_ID=<id>`` in its environment, so its ranks are
found by that marker, never by name: DeepSpeed's own interrupt handler runs ``pkill -f`` on a
command-line pattern that would match every DeepSpeed launch of the same interpreter on the host,
other users' included.

On another host the same code runs as a module, with the interpreter and ``PYTHONPATH`` the ranks
use there::

    python -m textsql.launching.ranks end --launch-id 5f0c2a9e41d7b3c8

Usage::

    >>> RemoteRanks(["-F", "runs/r1/ssh_config"], ["127.0.0.2", "127.0.0.3"], launch_id).end()
    >>> end_marked(launch_id)   # this machine only
    3
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from textsql.constants import PROJECT_DIR
from textsql.rank_lines import LAUNCH_ID_VAR, RUN_MARK_VAR
from worker.processes import end_processes
from worker.ssh import ssh_argv

logger = logging.getLogger(__name__)

# How long ranks get to exit after SIGTERM before SIGKILL.
END_GRACE_S = 10.0
# How long ssh gets to connect and report, on top of the grace.
SSH_SLACK_S = 20.0
POLL_S = 0.2
MODULE = "textsql.launching.ranks"


def marker(launch_id: str, variable: str = LAUNCH_ID_VAR) -> str:
    """The ``NAME=value`` environment entry that marks the processes of a launch.

    :param launch_id: the launch's id.
    :param variable: the marking variable (another one marks a whole pipeline's attempt: textsql.pipeline.leftovers).
    :rtype: str
    """
    return f"{variable}={launch_id}"


def marked_processes(launch_id: str, variable: str = LAUNCH_ID_VAR, run: str | None = None) -> list[int]:
    """Pids of this machine's processes (this one excepted) whose environment carries the launch's marker.

    Read from ``/proc/PID/environ``: the environment a process started with, which is where the
    launcher put the marker; processes of other users cannot be read and are skipped.

    :param launch_id: the launch's id.
    :param variable: the marking variable.
    :param run: the run's mark (:func:`textsql.rank_lines.run_mark`), which the processes must carry too.
    :rtype: list[int]
    """
    entries = {marker(launch_id, variable).encode()} | ({marker(run, RUN_MARK_VAR).encode()} if run else set())
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as environ:
                    if entries <= set(environ.read().split(b"\0")):
                        found.append(int(name))
            except OSError:  # ended meanwhile, or not ours
                pass
    return found


def end_marked(
    launch_id: str, grace: float = END_GRACE_S, variable: str = LAUNCH_ID_VAR, run: str | None = None
) -> int:
    """SIGTERM every marked process on this machine, then SIGKILL what is left after ``grace`` seconds.

    :param launch_id: the launch's id.
    :param grace: seconds the processes get to exit by themselves.
    :param variable: the marking variable.
    :param run: the run's mark, which the processes must carry too.
    :rtype: int
    :returns: how many processes carried the marker.
    """
    pids = marked_processes(launch_id, variable, run)
    killed = end_processes(pids, lambda: marked_processes(launch_id, variable, run), grace, POLL_S)
    if killed:
        logger.warning(
            "%d processes of launch %s outlived %.0f s after SIGTERM; sent SIGKILL", len(killed), launch_id, grace
        )
    return len(pids)


def remote_end_command(launch_id: str, grace: float = END_GRACE_S) -> str:
    """The shell command that ends a launch's processes on another host.

    The interpreter path is this one's, as for the ranks (their ``PATH`` starts with its directory),
    and ``PYTHONPATH`` the ranks' own, so the host runs this very module.

    :param launch_id: the launch's id.
    :param grace: seconds before SIGKILL.
    :rtype: str
    """
    return shlex.join(
        [
            "env",
            f"PYTHONPATH={PROJECT_DIR}",
            sys.executable,
            "-m",
            MODULE,
            "end",
            "--launch-id",
            launch_id,
            "--grace",
            str(grace),
        ]
    )


class LocalRanks:
    """The processes of one launch on this machine."""

    def __init__(self, launch_id: str) -> None:
        """
        :param launch_id: the launch's id.
        """
        self.launch_id = launch_id

    def end(self) -> None:
        """End every process of the launch here; returns once they are gone."""
        end_marked(self.launch_id)


class RemoteRanks:
    """The processes of one launch on the hosts, ended over ssh on all hosts at once."""

    def __init__(self, ssh_options: Sequence[str], hosts: Sequence[str], launch_id: str) -> None:
        """
        :param ssh_options: the options pdsh's ssh runs with for this launch.
        :param hosts: the launch's hosts.
        :param launch_id: the launch's id.
        """
        self.ssh_options, self.hosts, self.launch_id = list(ssh_options), list(hosts), launch_id

    def end(self) -> None:
        """End every process of the launch on every host; a host that cannot be reached is logged, not raised."""
        remote = remote_end_command(self.launch_id)
        enders = [
            subprocess.Popen(
                ssh_argv(self.ssh_options, host, remote),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for host in self.hosts
        ]
        for host, ender in zip(self.hosts, enders):
            try:
                _, error = ender.communicate(timeout=END_GRACE_S + SSH_SLACK_S)
            except subprocess.TimeoutExpired:
                ender.kill()
                _, error = ender.communicate()
            if ender.returncode != 0:
                logger.warning(
                    "could not end the ranks on %s: %s", host, error.strip() or f"exit code {ender.returncode}"
                )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m textsql.launching.ranks end --launch-id ID [--grace S]``: what :class:`RemoteRanks` runs on each host.

    :param argv: the arguments (default: the command line's).
    :rtype: int
    """
    parser = argparse.ArgumentParser(prog="python -m textsql.launching.ranks", description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    end = commands.add_parser("end", help="SIGTERM the launch's processes on this host, SIGKILL them after the grace.")
    end.add_argument("--launch-id", required=True, help=f"the launch's {LAUNCH_ID_VAR} value")
    end.add_argument("--grace", type=float, default=END_GRACE_S, help="seconds before SIGKILL (default: %(default)s)")
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    count = end_marked(arguments.launch_id, arguments.grace)
    logger.info("ended %d processes of launch %s", count, arguments.launch_id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
