"""Watch a launch's output on its way to the screen: what tells one failure from another, and when it stalled.

:func:`textsql.launching.launch.launch` writes every line of the ranks, pdsh and DeepSpeed's launcher to a
:class:`LaunchWatch`, which passes it on and keeps, per host, the exit codes and killing signals, the last
exception line and the last line; rank 0's steps (the last sign of progress, and the relaunch's first step);
and, through its :class:`textsql.launching.stall.StallDetector`, whether no rank advances any more: its
:meth:`LaunchWatch.stalled` is the launch's ``should_stop``, so a stalled launch is stopped on every host.
:func:`textsql.launching.recovery.classify` reads what it kept once the launch has ended.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from textsql.console import TextSink
from textsql.launching.failures import Failure, FailureKind, killing_signal
from textsql.launching.launch import PDSH_HOST_FAILED
from textsql.launching.stall import StallDetector
from textsql.rank_lines import rank0_step, split_host_prefix
from textsql.sanitize import sanitized

logger = logging.getLogger(__name__)

# DeepSpeed's launch.py on a host, when one of its ranks failed: the rank's own return code.
RANK_RETURN = re.compile(r"exits with return code = (?P<code>-?\d+)")
# A DeepSpeed launcher log line ("[2025-01-01 10:00:00,000] [INFO] ..."): never a rank's own last word.
LAUNCHER_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d ")
TRACEBACK = "Traceback (most recent call last):"
# Tracebacks that end in these are a process leaving as told (DeepSpeed's launch.py handling the SIGTERM
# this side sends, an interrupt), never a rank's own error.
NOT_A_CAUSE = re.compile(r"^(SystemExit|KeyboardInterrupt)\b")
# torch's prefix on what a rank writes to stderr once its process group exists.
TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")


class LaunchWatch:
    """The stream :func:`textsql.launching.launch.launch` writes to: passes every line on, and keeps what tells
    one failure from another (per host: exit codes, killing signals, the last exception line)."""

    def __init__(
        self,
        stream: TextSink,
        hosts: list[str],
        on_first_step: Callable[[int], None] | None = None,
        detector: StallDetector | None = None,
    ) -> None:
        """
        :param stream: where the lines go on to.
        :param hosts: the launch's hosts in the hostfile's order (pdsh prefixes each line with ``host: ``; the first
            runs rank 0); empty for the local launcher.
        :param on_first_step: called with the step number of the launch's first ``step N/M`` line (rank 0's).
        :param detector: reads every line for progress; :meth:`stalled` asks it.
        """
        self.stream, self.hosts, self.on_first_step = stream, list(hosts), on_first_step
        self._host_set = frozenset(hosts)
        self.detector = detector or StallDetector()
        # When this side found the launch stalled (and told it to stop), and the stall's failure.
        self.stall: Failure | None = None
        self.exits: list[tuple[str | None, int]] = []
        self.errors: dict[str | None, str] = {}
        self.last: dict[str | None, str] = {}
        self.first_failure_at: float | None = None
        self.started_at = time.time()
        # The last step rank 0 logged, and when this side read it: the last sign of progress.
        self.step: int | None = None
        self.step_at: float | None = None
        self._in_traceback: set[str | None] = set()
        self._partial = ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._read(line)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def stalled(self) -> bool:
        """Whether the launch has stalled (the launch's ``should_stop``); the first time, the stall is recorded.

        :rtype: bool
        """
        if self.stall is None and self.detector.stalled():
            hosts = [host or "this machine" for host in self.detector.stalled_hosts()] or ["this machine"]
            self.first_failure_at = time.time()
            self.stall = Failure(
                FailureKind.STALL,
                hosts[0],
                0,
                f"{self.detector.summary()}; stalled: {', '.join(hosts)}",
            )
        return self.stall is not None

    def _read(self, line: str) -> None:
        # What is kept from here (failure messages, events, supervisor.json) is shown to a person: inert.
        line = sanitized(line)
        self.detector.read(line)
        failed = PDSH_HOST_FAILED.match(line)
        if failed:
            self._exit(failed["host"], int(failed["code"]))
            return
        host, text = split_host_prefix(line, self._host_set)
        text = TORCH_RANK_PREFIX.sub("", text)
        # Only rank 0 prints steps: the same line from another host is not its word.
        stepped = rank0_step(line, self.hosts)
        if stepped:
            self._step(int(stepped["step"]))
        returned = RANK_RETURN.search(text)
        if returned and killing_signal(int(returned["code"])):
            self._exit(host, int(returned["code"]))
        if text.startswith(TRACEBACK):
            self._in_traceback.add(host)
        elif host in self._in_traceback and text and not text[0].isspace():
            # The first unindented line after the frames: "SomeError: message".
            if not NOT_A_CAUSE.match(text):
                self.errors[host] = text
            self._in_traceback.discard(host)
        elif text.strip() and not LAUNCHER_LOG.match(text):
            self.last[host] = text.strip()

    def _step(self, step: int) -> None:
        first = self.step is None
        self.step, self.step_at = step, time.time()
        if first and self.on_first_step is not None:
            self.on_first_step(step)

    def _exit(self, host: str | None, code: int) -> None:
        if self.first_failure_at is None:
            self.first_failure_at = time.time()
        self.exits.append((host, code))
