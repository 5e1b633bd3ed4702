"""The per-run rendezvous token: created once by the master (file mode 0600), read by every worker.

Only the file's path travels (environment, pod spec, command line); the value is never logged.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from worker.errors import RendezvousError
from worker.files import atomic_write

logger = logging.getLogger(__name__)


def new_token(path: Path) -> str:
    """Create a per-run token file (mode 0600) and return the token.

    :param path: where to write it.
    :rtype: str
    """
    token = secrets.token_urlsafe(32)
    atomic_write(Path(path), token + "\n", mode=0o600)
    return token


def read_token(path: Path, group: int | None = None) -> str:
    """The token from a token file, refusing files others can read.

    :param path: the token file (symlinks followed: a Kubernetes Secret mount links through ``..data``).
    :param group: a group id that may also read it (a pod's fsGroup); any other group-readable file is refused.
    :rtype: str
    """
    path = Path(path)
    try:
        status = path.stat()
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise RendezvousError(f"cannot read token file {str(path)!r}: {error.strerror}; pass --token-file") from None
    shared_with_group = group is not None and status.st_gid == group and not status.st_mode & 0o020
    if status.st_mode & (0o007 if shared_with_group else 0o077):
        raise RendezvousError(f"token file {str(path)!r} is readable by others; chmod 600 it")
    if len(token) < 16:
        raise RendezvousError(f"token file {str(path)!r} holds no usable token (under 16 characters)")
    return token
