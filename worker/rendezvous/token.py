"""The per-run rendezvous token and the per-pod keys derived from it.

The master creates the token once (file mode 0600) and keeps it. Each pod it launches gets only its own
key, :func:`pod_key` of the token and the pod's name, and signs its registration with it: a pod's key
proves that pod's name and no other, so one pod (or whoever reads its secret) cannot register as
another. A holder of the run token itself (the master, ``textsql rendezvous register`` on a host the
user trusts) derives the key for the pod it registers. Values are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from pathlib import Path

from worker.errors import RendezvousError
from worker.files import atomic_write

logger = logging.getLogger(__name__)

#: Marks a credential as one pod's key rather than the run token, so a worker handed either signs correctly.
POD_KEY_PREFIX = "textsql-pod-key."


def pod_key(token: str | bytes, pod: str) -> str:
    """The key that proves ``pod``'s registration: HMAC-SHA256 of its name under the run token.

    :param token: the run token.
    :param pod: the pod's name, as it registers.
    :rtype: str
    """
    secret = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    return POD_KEY_PREFIX + hmac.new(secret, b"textsql-pod:" + pod.encode("utf-8"), hashlib.sha256).hexdigest()


def signing_key(credential: str | bytes, pod: str) -> bytes:
    """The key a worker signs ``pod``'s registration with: its pod key as given, or derived from a run token.

    :param credential: a pod key (:func:`pod_key`) or the run token.
    :param pod: the pod's name, as it registers.
    :rtype: bytes
    """
    text = credential.decode("utf-8") if isinstance(credential, bytes) else credential
    return (text if text.startswith(POD_KEY_PREFIX) else pod_key(text, pod)).encode("utf-8")


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
