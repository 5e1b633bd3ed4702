"""What made a launch fail: its kind, the host, the exit code, the message, and its line in the records.

A :class:`textsql.launching.launch_watch.LaunchWatch` records a stall as a :class:`Failure` when it happens;
:func:`textsql.launching.recovery.classify` tells the other failures apart once the launch has ended. The kinds
and what the supervisor does about each are in :mod:`textsql.launching.recovery`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

logger = logging.getLogger(__name__)

# pdsh's exit code when ssh itself failed: the host is unreachable or its sshd is gone.
SSH_FAILED = 255


class FailureKind(str, Enum):
    """What made a launch fail (see :mod:`textsql.launching.recovery`); the value is the event's name in the records."""

    WORKER_LOST = "worker lost"
    APPLICATION_ERROR = "application error"
    STALL = "stall"


@dataclass(frozen=True)
class Failure:
    """Why a launch failed; ``message`` says what happened (for an application error, the rank's
    exception line: the same message twice is the same error)."""

    kind: FailureKind
    host: str | None
    code: int
    message: str

    def line(self, step: int | None, detected: float) -> str:
        """The event's line for a person: what, at which step, how soon it was seen."""
        at = f"at step {step}" if step is not None else "before the first step"
        if self.kind is FailureKind.WORKER_LOST:
            return f"worker lost {at} ({self.message}), detected after {detected:.1f} s"
        if self.kind is FailureKind.STALL:
            return f"stall {at}: {self.message}; every rank ended"
        return f"application error {at} on {self.host or 'this machine'}: {self.message} (exit code {self.code})"


def killing_signal(code: int) -> int | None:
    """The signal that ended a process, from an exit status: a shell's ``128+N``, DeepSpeed's
    launch.py's ``sys.exit(-N)`` (``256-N``), or Popen's ``-N``; None for an ordinary exit.

    :param code: the exit status.
    :rtype: int | None
    """
    if code < 0:
        return -code
    if 128 < code < 128 + 64:
        return code - 128
    if 256 - 64 < code < SSH_FAILED:
        return 256 - code
    return None
