"""Exceptions raised by the textsql library, on the base the worker side defines.

The worker's errors (:class:`RendezvousError`, :class:`HostfileError`, :class:`WorkerError`) and the
base :class:`TextSQLError` live in :mod:`worker.errors`, the lower layer; they are named here too so
that library code and users catch every project error from one module.
"""

from worker.errors import HostfileError, RendezvousError, TextSQLError, WorkerError

__all__ = [
    "DataError",
    "HostfileError",
    "LaunchError",
    "ModelError",
    "ProfileError",
    "RenamedOptionError",
    "RendezvousError",
    "SQLParseError",
    "StoreError",
    "TextSQLError",
    "WorkerError",
]


class DataError(TextSQLError):
    """Input data is malformed or incomplete (a bad line, a missing table, an unknown source)."""


class SQLParseError(TextSQLError):
    """Text could not be parsed back into a WikiSQL structured query."""


class ModelError(TextSQLError):
    """A model or tokenizer could not be loaded."""


class ProfileError(TextSQLError):
    """An unknown or invalid DeepSpeed profile."""


class LaunchError(TextSQLError):
    """The distributed launch could not start or a rank failed."""


class RenamedOptionError(LaunchError):
    """An option of the previous release, given under its old name: the message names the new one (click's
    usage-error exit status, 2, on the command line)."""


class StoreError(TextSQLError):
    """The checkpoint store (``--checkpoint-store``) cannot be used: unknown scheme, bucket, keys, permission."""
