"""The master's side of the rendezvous: a threading TCP server that collects authenticated registrations.

Each connection is served by a :class:`~worker.rendezvous.handler.RegistrationHandler` in its own thread;
the server keeps what the handlers record, writes the run's files once ``expect`` workers are in, and
releases them all when the run ends.

Usage::

    with RendezvousServer(expect=2, token=token, files=RunFiles.in_dir(run_dir)) as server:
        workers = server.wait(timeout=300)
        ...  # ssh / deepspeed over run_dir/ssh_config
    # leaving the block releases every worker
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self

from worker.beats import Beat
from worker.constants import (
    DEFAULT_RENDEZVOUS_PORT,
    HEARTBEAT_S,
    IDENTITY_NAME,
    MAX_CONNECTIONS,
    MAX_EXPECTED_WORKERS,
    MAX_UNAUTHENTICATED_PER_ADDRESS,
    REFUSAL_LOG_INTERVAL_S,
    REGISTER_TIMEOUT_S,
    RELEASE_HANGUP_S,
)
from worker.errors import RendezvousError
from worker.ratelog import RateLimitedLog
from worker.registration import Registration
from worker.rendezvous.handler import RegistrationHandler
from worker.rendezvous.registry import Accepted, Refused, Registry
from worker.rendezvous.token import new_token, read_token
from worker.runfiles import RunFiles, write_run_files

logger = logging.getLogger(__name__)


class RendezvousServer(socketserver.ThreadingTCPServer):
    """Collects ``expect`` authenticated registrations, then writes the run's files.

    Methods for the caller: :meth:`start` (serve in a thread), :meth:`wait`, :meth:`release`,
    :meth:`close` (all three on leaving a ``with`` block), :attr:`endpoint`, :attr:`workers`.

    Methods for handlers: :meth:`authenticated`, :meth:`record`, :meth:`forget`, :meth:`relay`; :attr:`refusals`
    for lines a hostile peer can trigger; :attr:`release_signal` turns readable once the workers are released.

    :attr:`beats_to` (None: nowhere; the launch's stall detector) is given, from the handlers' threads, every
    heartbeat a held worker relays, with the address it registered.

    Connections are counted from accept to close: at most :attr:`max_connections` in all, and at most
    :attr:`max_unauthenticated_per_address` from one address that have not yet authenticated.
    """

    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False
    # A whole cluster connects at once: a shorter listen backlog drops connects that TCP retries ~1 s later.
    request_queue_size = MAX_CONNECTIONS
    #: Connections handled at once (one thread each); more are closed at accept.
    max_connections = MAX_CONNECTIONS
    #: Connections from one address not yet authenticated; more from it are closed at accept.
    max_unauthenticated_per_address = MAX_UNAUTHENTICATED_PER_ADDRESS

    def __init__(
        self,
        expect: int,
        token: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        files: RunFiles | None = None,
        identity_file: Path | None = None,
        read_timeout: float = REGISTER_TIMEOUT_S,
        heartbeat: float = HEARTBEAT_S,
        check_peer: bool = False,
    ) -> None:
        """
        :param expect: how many workers make the run complete.
        :param token: the per-run secret (never logged).
        :param host: address to listen on: the interface the workers reach ("0.0.0.0" only where it is unknown).
        :param port: port to listen on; 0 lets the OS choose (see :attr:`endpoint`).
        :param files: where to write hostfile, known_hosts and ssh_config once complete (None: nowhere).
        :param identity_file: the run's ssh private key, named in ssh_config.
        :param read_timeout: seconds a new connection has to send its registration (and a held one its detach).
        :param heartbeat: seconds between keepalives on held connections.
        :param check_peer: refuse a registration whose address is not the connection's source address
            (where every worker has its own address and connects from it: the launching backends).
        """
        if isinstance(expect, bool) or not isinstance(expect, int) or not 1 <= expect <= MAX_EXPECTED_WORKERS:
            raise RendezvousError(f"expected worker count {expect!r} must be 1..{MAX_EXPECTED_WORKERS}; pass --expect")
        self.token = token.encode("utf-8") if isinstance(token, str) else bytes(token)
        if len(self.token) < 16:
            raise RendezvousError(
                "the rendezvous token is shorter than 16 bytes; create one with secrets.token_urlsafe()"
            )
        self.expect = expect
        self.files = files
        self.identity_file = identity_file
        self.read_timeout = read_timeout
        self.heartbeat = heartbeat
        self.check_peer = check_peer
        self.registry = Registry(expect)
        # Set once every worker registered and the run's files are written.
        self._ready = threading.Event()
        self._failure: Exception | None = None
        # Guards the connection counts below (the registry has its own lock).
        self._lock = threading.Lock()
        self._connections = 0
        # Accepted connections, each mapped to its peer address until it authenticates (then to None).
        self._open: dict[socket.socket, str | None] = {}
        self._unauthenticated: dict[str, int] = {}
        self._idle = threading.Condition(self._lock)
        self.refusals = RateLimitedLog(logger, REFUSAL_LOG_INTERVAL_S)
        self.released = threading.Event()
        self.beats_to: Callable[[str, Beat], None] | None = None
        # Held connections select on this pair so a release wakes them at once, without polling.
        self.release_signal, self._release_writer = socket.socketpair()
        self._thread: threading.Thread | None = None
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            super().__init__((host, port), RegistrationHandler)
        except OSError as error:
            self.release_signal.close()
            self._release_writer.close()
            raise RendezvousError(f"cannot listen on {host}:{port}: {error.strerror}; pick another --port") from None

    @property
    def endpoint(self) -> tuple[str, int]:
        """The (host, port) actually bound.

        :rtype: tuple[str, int]
        """
        host, port = self.server_address[:2]
        return str(host), int(port)

    @property
    def workers(self) -> list[Registration]:
        """Registrations so far, in node-rank order (IPv4 then IPv6, each by address).

        :rtype: list[Registration]
        """
        return self.registry.workers

    def start(self) -> Self:
        """Serve in a background thread.

        :rtype: RendezvousServer
        """
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="rendezvous", daemon=True
        )
        self._thread.start()
        logger.info("rendezvous listening on %s:%d for %d workers", *self.endpoint, self.expect)
        return self

    def verify_request(self, request: Any, client_address: Any) -> bool:
        peer = client_address[0]
        with self._lock:
            if self._connections >= self.max_connections:
                reason = f"{self._connections} connections open"
            elif self._unauthenticated.get(peer, 0) >= self.max_unauthenticated_per_address:
                reason = f"{self.max_unauthenticated_per_address} connections from it not yet authenticated"
            else:
                self._connections += 1
                self._open[request] = peer
                self._unauthenticated[peer] = self._unauthenticated.get(peer, 0) + 1
                return True
        self.refusals.log(logging.WARNING, "refusing connection from %s: %s", peer, reason)
        return False

    def shutdown_request(self, request: Any) -> None:
        # Called once for every accepted connection, after its handler, and for refused ones.
        with self._lock:
            if request in self._open:
                self._uncount(self._open.pop(request))
                self._connections -= 1
                self._idle.notify_all()
        super().shutdown_request(request)

    def _uncount(self, peer: str | None) -> None:
        if peer is not None:
            self._unauthenticated[peer] -= 1
            if not self._unauthenticated[peer]:
                del self._unauthenticated[peer]

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.exception("rendezvous handler for %s failed", client_address[0])

    def authenticated(self, request: socket.socket) -> None:
        """A connection proved it holds the token: it no longer counts against its address's limit.

        :param request: the handler's connection.
        """
        with self._lock:
            if self._open.get(request) is not None:
                self._uncount(self._open[request])
                self._open[request] = None

    def record(self, registration: Registration, handler: RegistrationHandler) -> Accepted | Refused:
        """Record an authenticated registration; the last one completes the run and writes its files.

        The registry decides under its lock; the files are written after it, outside the lock.

        :param registration: the worker's validated fields.
        :param handler: the connection it came on, the only one that speaks for this worker from now on.
        :rtype: Accepted | Refused
        """
        outcome = self.registry.record(registration, handler)
        if isinstance(outcome, Accepted) and outcome.complete is not None:
            self._finish(outcome.complete)
        return outcome

    def _finish(self, workers: tuple[Registration, ...]) -> None:
        """All workers are in: write the run's files, then let :meth:`wait` return."""
        try:
            if self.files is not None:
                write_run_files(self.files, workers, self.identity_file)
        except Exception as error:  # noqa: BLE001 - reported by wait(), which the caller is blocked in
            self._failure = error
        self._ready.set()

    def forget(self, registration: Registration, handler: RegistrationHandler, reason: str = "") -> None:
        """A held worker hung up: drop its registration unless the run is already complete.

        :param registration: what the worker registered.
        :param handler: its connection (one that does not hold the registration changes nothing).
        :param reason: why the connection ended, for the log.
        """
        self.registry.forget(registration, handler, reason)

    def relay(self, registration: Registration, handler: RegistrationHandler, beats: list[Beat]) -> None:
        """Heartbeats a held worker relayed, signed with its pod's key: to :attr:`beats_to`, under the address it
        registered, while its registration stands (a worker given up speaks for no address any more).

        :param registration: what the worker registered.
        :param handler: its connection.
        :param beats: its ranks' newest heartbeats.
        """
        receive = self.beats_to
        if receive is not None and self.registry.holds(registration, handler):
            for beat in beats:
                receive(registration.address, beat)

    def lost(self) -> dict[str, str]:
        """Workers whose agent hung up after the run was complete (its pod is gone or cut off): address -> why.

        :rtype: dict[str, str]
        """
        return self.registry.lost()

    def reopen(self, address: str) -> None:
        """Make room for a replacement of the worker at ``address``: its pod is retired (it never registers
        again) and the run is incomplete until one more worker registers (the files are rewritten with its host key).

        :param address: the lost worker's address.
        """
        self._ready.clear()
        self._failure = None
        self.registry.reopen(address)

    def drop(self, address: str) -> None:
        """Go on without the worker at ``address`` (lost, not replaced): the run is full again with the
        workers registered, so a replacement that registers late is refused. The caller writes the files.

        :param address: the lost worker's address.
        """
        self.registry.drop(address)
        self.expect = self.registry.expect
        self._failure = None
        self._ready.set()

    def wait(
        self,
        timeout: float,
        expected_pods: Iterable[str] | None = None,
        check: Callable[[], None] | None = None,
        total: float | None = None,
    ) -> list[Registration]:
        """Block until ``expect`` workers registered and the files are written.

        :param timeout: seconds to wait.
        :param expected_pods: names of launched pods, to say which ones are missing.
        :param check: called about twice a second; raise from it to stop waiting (a pod died).
        :param total: the whole start's timeout, for the error message (default: ``timeout``).
        :rtype: list[Registration]
        :raises RendezvousError: one line naming how many came and which are missing.
        """
        deadline = time.monotonic() + timeout
        while not self._ready.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                raise RendezvousError(self._missing_message(timeout if total is None else total, expected_pods))
        if self._failure is not None:
            raise RendezvousError(
                f"all {self.expect} workers registered but the run files could not be written: {self._failure}"
            )
        return self.workers

    def _missing_message(self, timeout: float, expected_pods: Iterable[str] | None) -> str:
        came = self.workers
        message = f"only {len(came)} of {self.expect} workers registered within {timeout:.0f}s"
        if expected_pods is not None:
            arrived = {r.pod for r in came}
            missing = [pod for pod in expected_pods if pod not in arrived]
            message += f"; missing: {', '.join(missing) or 'none of the launched pods'}"
        else:
            message += f"; registered: {', '.join(r.address for r in came) or 'none'}"
        return (
            message + "; check the workers' logs, the token and that they can reach this address, or raise the timeout"
        )

    def release(self) -> None:
        """Tell every held worker it is released (they stop sshd and exit)."""
        self.released.set()
        try:
            self._release_writer.send(b"r")
        except OSError:
            pass

    def close(self, drain_s: float = RELEASE_HANGUP_S) -> None:
        """Release workers, stop serving, close the sockets. Safe to call twice.

        :param drain_s: seconds to let handlers deliver the release and see their workers hang up
            before the sockets are closed.
        """
        self.release()
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        with self._lock:
            self._idle.wait_for(lambda: self._connections == 0, timeout=drain_s)
        self.server_close()
        self.release_signal.close()
        self._release_writer.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def serve(
    expect: int,
    token_file: Path,
    hostfile: Path,
    timeout: float,
    host: str = "127.0.0.1",
    port: int | None = None,
    identity_file: Path | None = None,
    hold: bool = False,
) -> list[Registration]:
    """``textsql rendezvous serve``: wait for ``expect`` workers, write hostfile, known_hosts, ssh_config (those two
    beside the hostfile); a missing token file is created (0600).

    :param expect: number of workers.
    :param token_file: the per-run token file.
    :param hostfile: where the DeepSpeed hostfile goes.
    :param timeout: seconds to wait for all workers.
    :param host: address to listen on: the interface the workers reach (default: this machine only).
    :param port: port to listen on (0: any; None: ``DEFAULT_RENDEZVOUS_PORT``).
    :param identity_file: the private key ssh_config names (default: id_ed25519 beside the hostfile).
    :param hold: keep holding the workers' connections after writing the files, until interrupted.
    :rtype: list[Registration]
    """
    hostfile = Path(hostfile).resolve()
    hostfile.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token_file = Path(token_file)
    token = read_token(token_file) if token_file.exists() else new_token(token_file)
    siblings = RunFiles.in_dir(hostfile.parent)
    files = RunFiles(hostfile, siblings.known_hosts, siblings.ssh_config)
    port = DEFAULT_RENDEZVOUS_PORT if port is None else port
    with RendezvousServer(
        expect=expect,
        token=token,
        host=host,
        port=port,
        files=files,
        identity_file=identity_file or hostfile.parent / IDENTITY_NAME,
    ) as server:
        workers = server.wait(timeout)
        if hold:
            logger.info("holding %d workers until interrupted", len(workers))
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                logger.info("releasing workers")
    return workers
