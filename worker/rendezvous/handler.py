"""One worker's connection on the master: hello, authenticated registration, reply, hold until release.

The handler speaks the protocol; what it learns it hands to its :class:`~worker.rendezvous.server.RendezvousServer`
through the server's methods for handlers (:meth:`authenticated`, :meth:`record`, :meth:`forget`,
:attr:`refusals` and :attr:`release_signal`), which keep the run's state and count the connections.
"""

from __future__ import annotations

import logging
import selectors
import socketserver
from typing import TYPE_CHECKING

from worker.constants import PROTOCOL_VERSION, READ_TIMEOUT_S, RELEASE_HANGUP_S
from worker.protocol import FrameError, is_nonce, new_nonce, recv_frame, send_frame, sign, verify
from worker.registration import InvalidRegistration, Registration

if TYPE_CHECKING:
    from worker.rendezvous.server import RendezvousServer

logger = logging.getLogger(__name__)


class RegistrationHandler(socketserver.StreamRequestHandler):
    """One worker's connection: authenticate, validate, record, then hold until release."""

    timeout = READ_TIMEOUT_S  # applied to the socket in setup(); reads also carry a per-frame deadline
    disable_nagle_algorithm = True

    server: RendezvousServer

    def handle(self) -> None:
        peer = self.client_address[0]
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
        if not verify(self.server.token, message.get("mac"), "register", server_nonce, client_nonce, worker):
            self.server.refusals.log(logging.WARNING, "registration from %s refused: authentication failed", peer)
            self._reply(
                server_nonce,
                client_nonce,
                "rejected",
                "authentication failed: the token does not match this run's; use the run's token file",
            )
            return
        self.server.authenticated(self.connection)
        try:
            registration = Registration.from_dict(worker)
        except InvalidRegistration as error:
            logger.warning("registration from %s refused: %s", peer, error)
            self._reply(server_nonce, client_nonce, "rejected", str(error))
            return
        refusal = self.server.record(registration, self)
        if refusal:
            logger.warning("registration of %s refused: %s", registration.address, refusal)
            self._reply(server_nonce, client_nonce, "rejected", refusal)
            return
        if not self._reply(server_nonce, client_nonce, "accepted", ""):
            self.server.forget(registration, self)
            return
        self._hold(registration, server_nonce, client_nonce)

    def _reply(self, server_nonce: str, client_nonce: str, kind: str, reason: str) -> bool:
        mac = sign(self.server.token, kind, server_nonce, client_nonce, reason)
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
                {"type": "released", "mac": sign(self.server.token, "released", server_nonce, client_nonce)},
            )
            self.connection.settimeout(RELEASE_HANGUP_S)
            self.connection.recv(1)  # a worker sends nothing after its release: this returns at its hang-up
        except FrameError as error:
            logger.info("could not release %s: %s", self.client_address[0], error)
        except OSError:  # no hang-up in time, or a reset: the backend's stop takes over
            pass

    def _hold(self, registration: Registration, server_nonce: str, client_nonce: str) -> None:
        """Keep the connection until release, heartbeating; a worker that hangs up is dropped."""
        if self.server.released.is_set():  # released while this worker was still shaking hands
            self._send_release(server_nonce, client_nonce)
            return
        release_signal = self.server.release_signal
        with selectors.DefaultSelector() as selector:
            selector.register(self.connection, selectors.EVENT_READ)
            selector.register(release_signal, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select(timeout=self.server.heartbeat)}
                try:
                    if release_signal in ready or self.server.released.is_set():
                        self._send_release(server_nonce, client_nonce)
                        return
                    if self.connection in ready:
                        # A held worker sends one thing only: "detach" (registered, not holding on).
                        # Anything else, or a close, means it is gone.
                        if recv_frame(self.connection, timeout=self.server.read_timeout).get("type") == "detach":
                            logger.info("worker %s detached; its registration stays", registration.address)
                            return
                        raise FrameError("the worker sent something other than detach")
                    send_frame(self.connection, {"type": "heartbeat"})
                except FrameError as error:
                    self.server.forget(registration, self, reason=str(error))
                    return
