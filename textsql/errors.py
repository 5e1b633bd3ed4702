"""Exceptions raised by textsql and worker.

Every error a user can cause carries a one-line message that names the fix; the CLI prints that
line alone (no traceback) and exits non-zero.
"""


class TextSQLError(Exception):
    """Base of every error this project raises on purpose."""


class DataError(TextSQLError):
    """Input data is malformed or incomplete (a bad line, a missing table, an unknown source)."""


class SQLParseError(TextSQLError):
    """Text could not be parsed back into a WikiSQL structured query."""


class ModelError(TextSQLError):
    """A model or tokenizer could not be loaded."""


class ProfileError(TextSQLError):
    """An unknown or invalid DeepSpeed profile."""


class RendezvousError(TextSQLError):
    """Workers could not register, or not all of them came in time."""


class HostfileError(TextSQLError):
    """A DeepSpeed hostfile is malformed, empty or has duplicate hosts."""


class WorkerError(TextSQLError):
    """A worker pod could not be launched, reached or stopped."""


class LaunchError(TextSQLError):
    """The distributed launch could not start or a rank failed."""
