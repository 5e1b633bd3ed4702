"""Log lines an unauthenticated peer can trigger, at most one per interval for each kind.

A flood of hostile connections must not turn into a flood of log lines: the first line of a kind
is written, the next ones within ``interval`` are only counted, and the count goes into the next
line of that kind that is written.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class RateLimitedLog:
    """Writes each kind of line (its format string) at most once per ``interval`` seconds.

    Usage::

        refusals = RateLimitedLog(logger, interval=5.0)
        refusals.log(logging.WARNING, "refusing connection from %s: %s", address, reason)
    """

    def __init__(self, target: logging.Logger, interval: float) -> None:
        """
        :param target: the logger lines go to.
        :param interval: seconds between two lines of the same kind.
        """
        self.target = target
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, message: str, *args: object) -> None:
        """Log ``message % args`` unless a line of the same ``message`` went out within the interval.

        :param level: a :mod:`logging` level.
        :param message: the format string; it is also the kind the interval is counted for.
        :param args: its arguments.
        """
        now = time.monotonic()
        with self._lock:
            last = self._last.get(message)
            if last is not None and now - last < self.interval:
                self._suppressed[message] = self._suppressed.get(message, 0) + 1
                return
            self._last[message] = now
            suppressed = self._suppressed.pop(message, 0)
        if suppressed:
            message += " (%d more like it since the last such line)"
            args = (*args, suppressed)
        self.target.log(level, message, *args)
