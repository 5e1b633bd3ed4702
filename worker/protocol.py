"""Wire format of the rendezvous: length-prefixed JSON frames and HMAC signatures.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding one object.
Every read is bounded twice: in bytes (``max_bytes``, checked against the length prefix before
anything is read) and in time (one deadline for the whole frame, so a peer dripping one byte at a
time cannot hold a reader longer than ``timeout``).

Messages that matter are signed with HMAC-SHA256 under the per-run token over both sides' nonces,
so a registration cannot be replayed into another session and a worker can tell a real release
from a forged one. Signatures are compared with :func:`hmac.compare_digest` on bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import time
from typing import Any, TypeGuard

from worker.constants import MAX_FRAME_BYTES, MAX_FRAME_DEPTH, READ_TIMEOUT_S
from worker.errors import RendezvousError

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")


class FrameError(RendezvousError):
    """A frame was malformed, too large, truncated, late, or the peer closed the connection."""


def canonical(value: object) -> bytes:
    """The one byte string both sides sign for ``value``: sorted keys, no spaces, ASCII only.

    :param value: any JSON-serialisable value.
    :rtype: bytes
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def sign(token: bytes, *parts: object) -> str:
    """HMAC-SHA256 of the canonical encoding of ``parts`` under ``token``, as hex.

    :param token: the per-run secret, as bytes.
    :param parts: what the signature covers (message type, nonces, body).
    :rtype: str
    """
    return hmac.new(token, canonical(list(parts)), hashlib.sha256).hexdigest()


def verify(token: bytes, signature: object, *parts: object) -> bool:
    """Whether ``signature`` is :func:`sign` of ``parts``; constant-time, on bytes.

    :param token: the per-run secret, as bytes.
    :param signature: the hex signature received (any type; non-strings never verify).
    :param parts: what the signature should cover.
    :rtype: bool
    """
    if not isinstance(signature, str) or not signature.isascii():
        return False
    return hmac.compare_digest(signature.encode("ascii"), sign(token, *parts).encode("ascii"))


def new_nonce() -> str:
    """A fresh nonce for one side of one connection (32 hex digits).

    :rtype: str
    """
    return secrets.token_hex(16)


def is_nonce(value: object) -> TypeGuard[str]:
    """Whether ``value`` is shaped like a nonce a peer may send (16..64 lowercase hex digits).

    :param value: a field of a received frame.
    :rtype: bool
    """
    return isinstance(value, str) and 16 <= len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


def encode_frame(message: dict[str, Any], max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """One frame holding ``message``.

    :param message: a JSON object.
    :param max_bytes: the largest body allowed.
    :rtype: bytes
    """
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(body) > max_bytes:
        raise FrameError(f"message of {len(body)} bytes exceeds the {max_bytes}-byte frame limit")
    return _LENGTH.pack(len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any], timeout: float = READ_TIMEOUT_S) -> None:
    """Send one frame, giving up after ``timeout`` seconds.

    :param sock: a connected TCP socket.
    :param message: a JSON object.
    :param timeout: seconds allowed for the whole send.
    """
    frame = encode_frame(message)
    sock.settimeout(timeout)
    try:
        sock.sendall(frame)
    except OSError as error:
        raise FrameError(f"could not send to the peer: {error}") from None


def _recv_exactly(sock: socket.socket, size: int, deadline: float, what: str) -> bytes:
    buffer = bytearray()
    while len(buffer) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FrameError(f"timed out reading the {what} ({len(buffer)} of {size} bytes arrived)")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(size - len(buffer), 65536))
        except TimeoutError:
            raise FrameError(f"timed out reading the {what} ({len(buffer)} of {size} bytes arrived)") from None
        except OSError as error:
            raise FrameError(f"connection failed while reading the {what}: {error}") from None
        if not chunk:
            if not buffer and what == "frame length":
                raise FrameError("the peer closed the connection")
            raise FrameError(f"truncated frame: the peer closed after {len(buffer)} of {size} {what} bytes")
        buffer += chunk
    return bytes(buffer)


def _depth(value: object) -> int:
    # Iterative, so that measuring a deep value cannot itself exhaust the stack.
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def recv_frame(
    sock: socket.socket, timeout: float = READ_TIMEOUT_S, max_bytes: int = MAX_FRAME_BYTES
) -> dict[str, Any]:
    """Read one frame: at most ``max_bytes`` of body, all of it within ``timeout`` seconds.

    :param sock: a connected TCP socket.
    :param timeout: seconds allowed for the whole frame, length prefix included.
    :param max_bytes: the largest body accepted; a larger length prefix is refused unread.
    :rtype: dict
    :raises FrameError: on timeout, close, oversize, truncation, a body that is not a JSON object, or one
        nested deeper than ``MAX_FRAME_DEPTH``.
    """
    deadline = time.monotonic() + timeout
    (size,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, deadline, "frame length"))
    if size == 0 or size > max_bytes:
        raise FrameError(f"frame of {size} bytes refused (limit {max_bytes})")
    body = _recv_exactly(sock, size, deadline, "frame body")
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FrameError("frame body is not UTF-8 JSON") from None
    except RecursionError:  # the parser recurses once per level: thousands of "[" fit in one frame
        raise FrameError(f"frame body nests deeper than {MAX_FRAME_DEPTH} levels") from None
    if _depth(message) > MAX_FRAME_DEPTH:
        raise FrameError(f"frame body nests deeper than {MAX_FRAME_DEPTH} levels")
    if not isinstance(message, dict):
        raise FrameError(f"frame holds a JSON {type(message).__name__}, not an object")
    return message
