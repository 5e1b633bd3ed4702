"""One worker's connection on the master: hello, authenticated registration, reply, hold until release, taking the
worker's signed heartbeats meanwhile.

The handler speaks the protocol; what it learns it hands to its :class:`~worker.rendezvous.server.RendezvousServer`
through the server's methods for handlers (:meth:`authenticated`, :meth:`record`, :meth:`forget`, :meth:`relay`,
:attr:`refusals` and :attr:`release_signal`), which keep the run's state and count the connections.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import selectors
import socketserver
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.beats import Beat, InvalidBeats, beats_from_wire
from worker.constants import (
    MAX_RELAYED_FRAME_BYTES,
    PROTOCOL_VERSION,
    READ_TIMEOUT_S,
    RELAYED_FRAMES_BURST,
    RELAYED_FRAMES_PER_S,
    RELEASE_HANGUP_S,
)
from worker.protocol import FrameError, is_nonce, new_nonce, recv_frame, send_frame, sign, verify
from worker.registration import InvalidRegistration, Registration
from worker.rendezvous.registry import Refused
from worker.rendezvous.token import pod_key

if TYPE_CHECKING:
    from worker.rendezvous.server import RendezvousServer

logger = logging.getLogger(__name__)

# What a heartbeat frame holds: the fields its signature covers, and the signature.
_SIGNED_FIELDS = {"type", "sequence", "beats", "mac"}


def claimed_pod(worker: object) -> str:
    """The pod name a register message claims (as :meth:`Registration.from_dict` reads it), to pick its key.

    :param worker: the message's ``worker`` object, not yet validated.
    :rtype: str
    """
    if not isinstance(worker, dict):
        return ""
    pod = worker.get("pod", worker.get("hostname"))
    return pod if isinstance(pod, str) else ""


class RegistrationHandler(socketserver.StreamRequestHandler):
    """One worker's connection: authenticate, validate, record, then hold until release."""

    timeout = READ_TIMEOUT_S  # applied to the socket in setup(); reads also carry a per-frame deadline
    disable_nagle_algorithm = True

    server: RendezvousServer

    def handle(self) -> None:
        peer = self.client_address[0]
        # What replies are signed with: the claimed pod's key once the message names a pod; before that a
        # throwaway key. Nothing is ever signed with the run token itself, so no reply is an oracle for it.
        self.key = secrets.token_bytes(32)
        server_nonce = new_nonce()
        try:
            send_frame(self.connection, {"type": "hello", "version": PROTOCOL_VERSION, "nonce": server_nonce})
            message = recv_frame(self.connection, timeout=self.server.read_timeout)
        except FrameError as error:
            self.server.refusals.log(logging.INFO, "connection from %s dropped before registering: %s", peer, error)
            return
        client_nonce = message.get("nonce")
        if message.get("type") != "register" or not is_nonce(client_nonce):
            self._reply(server_nonce, "", "rejected", "expected a register message with a nonce")
            return
        worker = message.get("worker")
        # Each pod signs with its own key, derived from the run token and the pod name it claims.
        self.key = pod_key(self.server.token, claimed_pod(worker)).encode("utf-8")
        if not verify(self.key, message.get("mac"), "register", server_nonce, client_nonce, worker):
            self.server.refusals.log(logging.WARNING, "registration from %s refused: authentication failed", peer)
            self._reply(
                server_nonce,
                client_nonce,
                "rejected",
                "authentication failed: the key does not match this run's key for the pod; use the pod's own key",
            )
            return
        self.server.authenticated(self.connection)
        try:
            registration = Registration.from_dict(worker)
        except InvalidRegistration as error:
            logger.warning("registration from %s refused: %s", peer, error)
            self._reply(server_nonce, client_nonce, "rejected", str(error))
            return
        outcome = self._refusal(registration, peer) or self.server.record(registration, self)
        if isinstance(outcome, Refused):
            logger.warning(
                "registration of %s (pod %s) refused: %s", registration.address, registration.pod, outcome.reason
            )
            self._reply(server_nonce, client_nonce, "rejected", outcome.reason)
            return
        if not self._reply(server_nonce, client_nonce, "accepted", ""):
            self.server.forget(registration, self)
            return
        self._hold(registration, server_nonce, client_nonce)

    def _refusal(self, registration: Registration, peer: str) -> Refused | None:
        """A registration whose address is not where it came from, where workers connect from their own address."""
        if self.server.check_peer and ipaddress.ip_address(peer) != ipaddress.ip_address(registration.address):
            return Refused(
                f"address {registration.address} is not the address this registration came from ({peer}); "
                "a worker registers its own address, from that address"
            )
        return None

    def _reply(self, server_nonce: str, client_nonce: str, kind: str, reason: str) -> bool:
        mac = sign(self.key, kind, server_nonce, client_nonce, reason)
        try:
            send_frame(self.connection, {"type": kind, "reason": reason, "mac": mac})
        except FrameError as error:
            logger.info("could not answer %s: %s", self.client_address[0], error)
            return False
        return True

    def _send_release(self, server_nonce: str, client_nonce: str) -> None:
        """Release the worker, then wait (bounded) for it to hang up: it has taken the release by then."""
        try:
            send_frame(
                self.connection,
                {"type": "released", "mac": sign(self.key, "released", server_nonce, client_nonce)},
            )
            self.connection.settimeout(RELEASE_HANGUP_S)
            self.connection.recv(1)  # a worker sends nothing after its release: this returns at its hang-up
        except FrameError as error:
            logger.info("could not release %s: %s", self.client_address[0], error)
        except OSError:  # no hang-up in time, or a reset: the backend's stop takes over
            pass

    def _hold(self, registration: Registration, server_nonce: str, client_nonce: str) -> None:
        """Keep the connection until release, heartbeating and taking the worker's relayed heartbeats; a worker
        that hangs up or breaks the protocol is dropped."""
        if self.server.released.is_set():  # released while this worker was still shaking hands
            self._send_release(server_nonce, client_nonce)
            return
        release_signal = self.server.release_signal
        relayed, budget = RelayedBeats(self.key, server_nonce, client_nonce), FrameBudget()
        with selectors.DefaultSelector() as selector:
            selector.register(release_signal, selectors.EVENT_READ)
            next_heartbeat = time.monotonic() + self.server.heartbeat
            while True:
                ready = self._ready(selector, budget, next_heartbeat)
                try:
                    if release_signal in ready or self.server.released.is_set():
                        self._send_release(server_nonce, client_nonce)
                        return
                    if self.connection in ready:
                        budget.spend()
                        message = recv_frame(
                            self.connection, timeout=self.server.read_timeout, max_bytes=MAX_RELAYED_FRAME_BYTES
                        )
                        # A held worker sends its ranks' heartbeats, or "detach" (registered, not holding on).
                        # Anything else, or a close, means it is gone.
                        if message.get("type") == "detach":
                            logger.info("worker %s detached; its registration stays", registration.address)
                            return
                        self.server.relay(registration, self, relayed.read(message))
                    if time.monotonic() >= next_heartbeat:
                        send_frame(self.connection, {"type": "heartbeat"})
                        next_heartbeat = time.monotonic() + self.server.heartbeat
                except FrameError as error:
                    self.server.forget(registration, self, reason=str(error))
                    return

    def _ready(self, selector: selectors.BaseSelector, budget: FrameBudget, next_heartbeat: float) -> set[object]:
        """What turns readable before the next heartbeat is due: the release signal, and the worker's connection
        while its frames are within their budget. Past it the connection is not read at all: its frames wait in
        TCP's buffers, and a flood's sends block, until the budget has grown again."""
        wait_s = budget.wait_s()
        reading = self.connection in selector.get_map()
        if reading and wait_s:
            selector.unregister(self.connection)
            self.server.refusals.log(
                logging.WARNING,
                "worker %s sends more than %d frames a second: its frames are read no faster",
                self.client_address[0],
                RELAYED_FRAMES_PER_S,
            )
        elif not reading and not wait_s:
            selector.register(self.connection, selectors.EVENT_READ)
        timeout = next_heartbeat - time.monotonic()
        return {key.fileobj for key, _ in selector.select(timeout=min(timeout, wait_s) if wait_s else timeout)}


class FrameBudget:
    """How many more frames a held connection may be read for: :data:`RELAYED_FRAMES_BURST` at first, and
    :data:`RELAYED_FRAMES_PER_S` more each second up to that (a token bucket).

    :param clock: seconds, monotonic.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.frames, self.counted_at = float(RELAYED_FRAMES_BURST), clock()

    def wait_s(self) -> float:
        """Seconds until one more frame may be read (0: now).

        :rtype: float
        """
        now = self.clock()
        self.frames = min(float(RELAYED_FRAMES_BURST), self.frames + (now - self.counted_at) * RELAYED_FRAMES_PER_S)
        self.counted_at = now
        return 0.0 if self.frames >= 1 else (1 - self.frames) / RELAYED_FRAMES_PER_S

    def spend(self) -> None:
        """One frame is being read."""
        self.frames -= 1


class RelayedBeats:
    """The heartbeat frames of one held connection, checked: signed with the pod's key over both nonces, each
    sequence number higher than the last (none replayed), the beats well formed.

    :param key: the pod's key.
    :param server_nonce: this connection's master nonce.
    :param client_nonce: this connection's worker nonce.
    """

    def __init__(self, key: bytes, server_nonce: str, client_nonce: str) -> None:
        self.key, self.nonces, self.sequence = key, (server_nonce, client_nonce), 0

    def read(self, message: dict[str, Any]) -> list[Beat]:
        """The beats of one frame the worker sent.

        :param message: the frame.
        :rtype: list[Beat]
        :raises FrameError: when it is not a heartbeat frame, has a field the signature does not cover, is not
            signed with the pod's key, repeats or goes back in sequence, or its beats are malformed.
        """
        sequence, wire = message.get("sequence"), message.get("beats")
        if message.get("type") != "beats":
            raise FrameError("the worker sent something other than heartbeats or detach")
        if message.keys() != _SIGNED_FIELDS:
            raise FrameError("a heartbeat frame with fields besides type, sequence, beats and mac")
        if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence <= self.sequence:
            raise FrameError("a heartbeat frame out of sequence")
        if not verify(self.key, message.get("mac"), "beats", *self.nonces, sequence, wire):
            raise FrameError("a heartbeat frame not signed with the pod's key")
        try:
            beats = beats_from_wire(wire)
        except InvalidBeats as error:
            raise FrameError(str(error)) from None
        self.sequence = sequence
        return beats
