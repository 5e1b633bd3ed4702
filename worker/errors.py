"""Exceptions of the worker side, and the base of every error this project raises on purpose.

The base lives here, in the lower layer, so that an agent on a pod needs nothing from the training
library; :mod:`textsql.errors` builds the library's own errors on it. Every error a user can cause
carries a one-line message that names the fix; the CLI prints that line alone (no traceback) and
exits non-zero.
"""


class TextSQLError(Exception):
    """Base of every error this project raises on purpose."""


class RendezvousError(TextSQLError):
    """Workers could not register, or not all of them came in time."""


class HostfileError(TextSQLError):
    """A DeepSpeed hostfile is malformed, empty or has duplicate hosts."""


class WorkerError(TextSQLError):
    """A worker pod could not be launched, reached or stopped."""
