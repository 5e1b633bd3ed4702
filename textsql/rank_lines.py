"""The lines a training rank prints for the launcher's side: one protocol, written by the ranks
(:mod:`textsql.training.progress`) and read by the supervisor (:mod:`textsql.launching.stall`,
:mod:`textsql.launching.launch_watch`) and the displays (:mod:`textsql.display.terminal`, :mod:`textsql.console`).

- ``step N/M: loss L (T s)`` and ``step N/M: eval ...``: rank 0, on each logged step and evaluation, with
  ``, S s left`` after the time once the run's pace is steady (:mod:`textsql.training.time_left`);
- ``stage: ...``: a stage of its own (what trains, DeepSpeed's op compilation);
- ``heartbeat rank R step S progress P``: every rank, every :data:`HEARTBEAT_INTERVAL_S` seconds;
- :data:`LAUNCH_ID_VAR`: what every process of one launch carries in its environment, beside
  :data:`RUN_MARK_VAR`, its run's mark (:func:`run_mark`).

Through pdsh each line arrives behind its host's ``host: `` prefix. A rank controls everything after that
prefix, so :func:`split_host_prefix` names a host only for the launch's own hosts, and a reader believes a line
only for what that host may say (its own ranks' heartbeats; step lines only from rank 0's host:
:func:`rank0_step`). pdsh prints a line with ``%s``: a rank's NUL drops
the rest of its line, newline included, and pdsh's next line, another host's too, is glued onto it. So a host's
text ends where another host's prefix appears in it: what follows is nobody's word (it may be the glued line of
an honest host, or a hostile host's forgery of one, and the two are the same bytes). A host whose worker agent
relays its ranks' heartbeats (:mod:`worker.beats`) is heard from there instead, out of every other host's reach.

Usage::

    >>> split_host_prefix("127.0.0.3: " + heartbeat_line(1, 4, 9), {"127.0.0.2", "127.0.0.3"})
    ('127.0.0.3', 'heartbeat rank 1 step 4 progress 9')
    >>> split_host_prefix("127.0.0.3: x127.0.0.2: " + heartbeat_line(0, 4, 9), {"127.0.0.2", "127.0.0.3"})
    ('127.0.0.3', 'x')
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from pathlib import Path

# The variable every process of one launch carries (value: a fresh random id per launch).
LAUNCH_ID_VAR = "TEXTSQL_LAUNCH_ID"
# The second marker every process of a run carries, its launches' and its pipeline attempt's: a process is ended as
# a run's leftover only when it carries the run's mark too, so an id on record can never reach another run.
RUN_MARK_VAR = "TEXTSQL_RUN_MARK"
# Seconds between a rank's heartbeat lines.
HEARTBEAT_INTERVAL_S = 5.0
_STEP = r"step (?P<step>\d+)/(?P<total>\d+): (?P<text>.*?)(?: \((?P<elapsed>\d+) s(?:, (?P<left>\d+) s left)?\))?$"
# A step line, behind pdsh's prefix or not (a person's terminal sees both): what it says, not whose word it is.
STEP_LINE = re.compile(r"^(?:\S+: )?" + _STEP)
# A step line as rank 0 prints it, its host's prefix taken off.
STEP_TEXT = re.compile("^" + _STEP)
STAGE_PREFIX = "stage: "
# A heartbeat line once its host's prefix is taken off (:func:`split_host_prefix`).
HEARTBEAT_LINE = re.compile(r"^heartbeat rank (?P<rank>\d+) step (?P<step>\d+) progress (?P<progress>\d+)$")


def step_line(step: int, total: int, text: str, elapsed: float, left: float | None = None) -> str:
    """The step line rank 0 prints; :data:`STEP_LINE` reads it.

    :param step: the optimizer step.
    :param total: the run's last step.
    :param text: what happened (``loss 3.210``, ``eval loss 2.1, lf_accuracy 0.500``).
    :param elapsed: seconds since the rank started.
    :param left: seconds the run has left (None: not known yet).
    :rtype: str
    """
    until = "" if left is None else f", {left:.0f} s left"
    return f"step {step}/{total}: {text} ({elapsed:.0f} s{until})"


def heartbeat_line(rank: int, step: int, progress: int) -> str:
    """The heartbeat line a rank prints; :data:`HEARTBEAT_LINE` reads it.

    :param rank: the rank's global rank.
    :param step: its optimizer step.
    :param progress: a count of everything it has finished (steps, evaluation batches, saves).
    :rtype: str
    """
    return f"heartbeat rank {rank} step {step} progress {progress}"


def split_host_prefix(line: str, hosts: Collection[str]) -> tuple[str | None, str]:
    """Which of the launch's hosts a line of its stream comes from, and its text: after pdsh's prefix, and before
    any other line glued onto it (see the module docstring).

    :param line: one line of the launch's stream, without its newline.
    :param hosts: the launch's hosts, a set or a dict (empty for the local launcher, whose lines carry no prefix).
    :rtype: tuple[str | None, str]
    :returns: ``(host, text)``; ``(None, line)`` when no host of the launch prefixes it.
    """
    host, separator, text = line.partition(": ")
    if separator and host in hosts:
        return host, text[: glued_at(text, hosts)]
    return None, line


def glued_at(text: str, hosts: Collection[str]) -> int:
    """Where in a host's text another line of pdsh's stream begins: the first ``HOST: `` of a host of the launch
    in it; ``len(text)`` when none. Linear in the text (a step per ``": "``, a set lookup per length of host name).

    :param text: a line's text after its host's prefix.
    :param hosts: the launch's hosts, a set or a dict.
    :rtype: int
    """
    colon = text.find(": ")
    if colon == -1:  # most lines, heartbeats among them: no host's list is needed
        return len(text)
    lengths = sorted({len(host) for host in hosts}, reverse=True)
    while colon != -1:
        for length in lengths:
            if length <= colon and text[colon - length : colon] in hosts:
                return colon - length
        colon = text.find(": ", colon + 1)
    return len(text)


def rank0_step(line: str, hosts: Collection[str]) -> re.Match[str] | None:
    """A step line of rank 0's: behind the prefix of the launch's first host, or with no prefix at all for the local
    launcher. Another host's step line (a worker speaking for rank 0) is none.

    :param line: one line of the launch's stream, without its newline.
    :param hosts: the launch's hosts in the hostfile's order, rank 0's first (empty for the local launcher).
    :rtype: re.Match | None
    """
    host, text = split_host_prefix(line, hosts)
    if host != next(iter(hosts), None):
        return None
    return STEP_TEXT.match(text)


def ranks_by_host(slots: dict[str, int]) -> dict[str, range]:
    """The global ranks each host runs, as DeepSpeed's launcher numbers them: in the hostfile's order,
    ``slots`` ranks a host.

    :param slots: the hostfile, host to slots, in its order.
    :rtype: dict[str, range]
    """
    ranks, first = {}, 0
    for host, count in slots.items():
        ranks[host] = range(first, first + count)
        first += count
    return ranks


def run_mark(run_dir: str | Path) -> str:
    """The value of :data:`RUN_MARK_VAR` for a run: a hash of its resolved run directory.

    :param run_dir: the run directory.
    :rtype: str
    """
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
