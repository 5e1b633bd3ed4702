"""The worker's side of the rendezvous: register, hold the accepted connection, learn of the release.

Usage::

    with register_until(("10.0.0.4", 29400), token, registration, deadline_s=300) as session:
        released = session.wait_released()   # False when the master went away instead
"""

from __future__ import annotations

import logging
import random
import selectors
import socket
import time
from pathlib import Path
from typing import Self

from worker.beats import Beat, BeatInbox
from worker.constants import BACKOFF_MAX_S, BACKOFF_START_S, MASTER_GONE_AFTER_S, PROTOCOL_VERSION, READ_TIMEOUT_S
from worker.errors import RendezvousError
from worker.protocol import FrameError, is_nonce, new_nonce, recv_frame, send_frame, sign, verify
from worker.registration import Registration
from worker.rendezvous.token import read_token, signing_key

logger = logging.getLogger(__name__)


class RegistrationRejected(RendezvousError):
    """The master refused a registration; the message is the master's reason."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[V6]:PORT``) as a (host, port) pair.

    :param text: e.g. ``10.0.0.4:29400``.
    :rtype: tuple[str, int]
    """
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise RendezvousError(f"master {text!r} must be HOST:PORT, e.g. 10.0.0.4:29400")
    return host, int(port)


class Session:
    """A worker's accepted registration: the open connection it waits for its release on, and relays its ranks'
    heartbeats on (:mod:`worker.beats`)."""

    def __init__(self, sock: socket.socket, token: bytes, server_nonce: str, client_nonce: str) -> None:
        self._sock = sock
        self._token = token
        self._nonces = (server_nonce, client_nonce)
        # Numbers the relayed frames: the master takes each number once, in order, so none is replayed.
        self._sequence = 0

    def wait_released(self, gone_after: float = MASTER_GONE_AFTER_S, beats: BeatInbox | None = None) -> bool:
        """Block (no polling) until released or the master is gone, relaying what arrives on ``beats``.

        :param gone_after: seconds without any frame after which the master counts as gone.
        :param beats: this pod's ranks' heartbeats, relayed to the master as they arrive (None: none).
        :rtype: bool
        :returns: True when the master released this worker, False when it went away.
        """
        heard_at = time.monotonic()
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            if beats is not None:
                selector.register(beats, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select(timeout=heard_at + gone_after - time.monotonic())}
                try:
                    if beats is not None and beats in ready:
                        self.relay(beats.drain())
                    if self._sock in ready:
                        heard_at = time.monotonic()
                        if self._released(recv_frame(self._sock)):
                            return True
                    elif time.monotonic() - heard_at >= gone_after:
                        raise FrameError(f"no frame for {gone_after:g} s")
                except FrameError as error:
                    logger.info("master gone: %s", error)
                    return False

    def _released(self, message: dict[str, object]) -> bool:
        if message.get("type") != "released":
            return False
        if verify(self._token, message.get("mac"), "released", *self._nonces):
            return True
        logger.warning("ignoring a release that is not signed with the run's token")
        return False

    def relay(self, beats: list[Beat]) -> None:
        """Send this pod's ranks' heartbeats to the master, signed with the pod's key.

        :param beats: the newest beat of each rank (nothing is sent for none).
        :raises FrameError: when the master cannot be reached.
        """
        if not beats:
            return
        self._sequence += 1
        wire = [list(beat) for beat in beats]
        mac = sign(self._token, "beats", *self._nonces, self._sequence, wire)
        send_frame(self._sock, {"type": "beats", "sequence": self._sequence, "beats": wire, "mac": mac})

    def detach(self) -> None:
        """Leave the registration in place without holding the connection (``textsql rendezvous register``)."""
        try:
            send_frame(self._sock, {"type": "detach"})
        finally:
            self._sock.close()

    def close(self) -> None:
        """Close the connection; before the run is complete the master then drops this worker."""
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def register(
    master: str | tuple[str, int],
    token: str | bytes,
    registration: Registration,
    timeout: float = READ_TIMEOUT_S,
    source: str | None = None,
) -> Session:
    """Register one worker with the master's rendezvous server.

    :param master: ``HOST:PORT`` or (host, port).
    :param token: the pod's key (:func:`~worker.rendezvous.token.pod_key`), or the run token to derive it from.
    :param registration: this worker's fields.
    :param timeout: seconds for connecting and for each reply.
    :param source: the local address to connect from (None: the one the route picks).
    :rtype: Session
    :raises RegistrationRejected: with the master's reason (not worth retrying).
    :raises FrameError: or OSError when the master could not be reached or hung up (worth retrying).
    """
    host, port = parse_endpoint(master) if isinstance(master, str) else master
    token = signing_key(token, registration.pod)
    sock = socket.create_connection((host, port), timeout=timeout, source_address=(source, 0) if source else None)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = recv_frame(sock, timeout=timeout)
        server_nonce = hello.get("nonce")
        if hello.get("type") != "hello" or not is_nonce(server_nonce):
            raise FrameError(f"{host}:{port} is not a textsql rendezvous server")
        if hello.get("version") != PROTOCOL_VERSION:
            raise RegistrationRejected(
                f"master {host}:{port} speaks rendezvous protocol {hello.get('version')!r}, "
                f"this worker {PROTOCOL_VERSION}; run the same textsql version on both"
            )
        client_nonce = new_nonce()
        worker = registration.to_dict()
        send_frame(
            sock,
            {
                "type": "register",
                "nonce": client_nonce,
                "worker": worker,
                "mac": sign(token, "register", server_nonce, client_nonce, worker),
            },
            timeout=timeout,
        )
        reply = recv_frame(sock, timeout=timeout)
        kind, reason = reply.get("type"), reply.get("reason", "")
        authentic = verify(token, reply.get("mac"), kind, server_nonce, client_nonce, reason)
        if kind == "accepted" and authentic:
            return Session(sock, token, server_nonce, client_nonce)
        if kind == "rejected":
            note = "" if authentic else " (reply not signed with this token: check the token file)"
            raise RegistrationRejected(f"master {host}:{port} refused {registration.address}: {reason}{note}")
        raise FrameError(f"unexpected or unauthenticated reply {kind!r} from {host}:{port}; check the token file")
    except BaseException:
        sock.close()
        raise


def register_until(
    master: tuple[str, int], token: str, registration: Registration, deadline_s: float, source: str | None = None
) -> Session:
    """Register, retrying unreachable masters with jittered exponential backoff until ``deadline_s``.

    :param master: (host, port) of the rendezvous.
    :param token: the per-run secret.
    :param registration: this worker.
    :param deadline_s: seconds to keep trying.
    :param source: the local address to connect from (None: the one the route picks).
    :rtype: Session
    :raises RegistrationRejected: at once when the master refuses (retrying would not help).
    :raises RendezvousError: when the deadline passes.
    """
    deadline = time.monotonic() + deadline_s
    delay = BACKOFF_START_S
    while True:
        try:
            return register(master, token, registration, source=source)
        except RegistrationRejected:
            raise
        except (FrameError, OSError) as error:
            if time.monotonic() + delay > deadline:
                raise RendezvousError(
                    f"could not register with {master[0]}:{master[1]} within {deadline_s:g}s: {error}"
                ) from None
            logger.info("master %s:%d not reachable yet (%s); retrying in %.1fs", *master, error, delay)
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, BACKOFF_MAX_S)


def register_once(
    master: str, token_file: Path, registration: Registration, timeout: float, wait: bool = False
) -> bool:
    """``textsql rendezvous register``: register one worker, retrying until ``timeout``.

    :param master: ``HOST:PORT`` of the rendezvous.
    :param token_file: the per-run token file.
    :param registration: the worker's fields.
    :param timeout: seconds to keep retrying an unreachable master.
    :param wait: hold the connection until released (True) or detach at once (False).
    :rtype: bool
    :returns: True when accepted (and, with ``wait``, released rather than abandoned).
    """
    session = register_until(parse_endpoint(master), read_token(Path(token_file)), registration, timeout)
    if not wait:
        session.detach()
        return True
    with session:
        return session.wait_released()
