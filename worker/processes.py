"""Ending processes as a machine's end would: SIGTERM, a grace to exit by themselves, then SIGKILL.

Used for a worker's ssh sessions when its sshd stops (:mod:`worker.sshd`) and for a launch's ranks on a host
(``textsql.launching.ranks``). Read from ``/proc``: workers and masters run on Linux.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its children, theirs, and so on), read from ``/proc``.

    :rtype: list[int]
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command's name is in parentheses and may hold spaces: the fields after it are split safely.
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # gone while read
        if state != "Z":
            children.setdefault(int(parent), []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def end_processes(pids: Sequence[int], find: Callable[[], list[int]], grace_s: float, poll_s: float) -> list[int]:
    """SIGTERM ``pids``, then, every ``poll_s`` seconds, ask ``find`` which are still there; SIGKILL what it still
    lists after ``grace_s`` seconds.

    :param find: the processes to end as of now (a process started meanwhile is ended too).
    :returns: the processes that got SIGKILL.
    :rtype: list[int]
    """
    send(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = find()
    send(left, signal.SIGKILL)
    return left


def send(pids: Sequence[int], signum: int) -> None:
    """``signum`` to each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # ended meanwhile
            pass
