"""The authenticated rendezvous: workers register over TCP, the master writes the run's files.

Conversation on one connection (frames from :mod:`worker.protocol`)::

    master -> worker  {"type": "hello", "version": 1, "nonce": SN}
    worker -> master  {"type": "register", "nonce": CN, "worker": {...}, "mac": HMAC(token, "register", SN, CN, worker)}
    master -> worker  {"type": "accepted" | "rejected", "reason": ..., "mac": HMAC(token, type, SN, CN, reason)}
    master -> worker  {"type": "heartbeat"} every few seconds while the run lasts, then
    master -> worker  {"type": "released", "mac": HMAC(token, "released", SN, CN)}

The worker holds its connection open after it is accepted: the master sees a worker that dies before
the run is complete (its registration is dropped), and the worker sees the master go away (no
heartbeat, or the connection closes) as well as its release, without polling.

Usage::

    with RendezvousServer(expect=2, token=token, files=RunFiles.in_dir(run_dir)) as server:
        workers = server.wait(timeout=300)
        ...  # ssh / deepspeed over run_dir/ssh_config
    # leaving the block releases every worker
"""
from __future__ import annotations

import ipaddress
import logging
import random
import secrets
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from worker.constants import (
    BACKOFF_MAX_S,
    BACKOFF_START_S,
    DEFAULT_RENDEZVOUS_PORT,
    HEARTBEAT_S,
    IDENTITY_NAME,
    MASTER_GONE_AFTER_S,
    MAX_CONNECTIONS,
    MAX_EXPECTED_WORKERS,
    PROTOCOL_VERSION,
    READ_TIMEOUT_S,
)
from worker.errors import RendezvousError
from worker.files import atomic_write
from worker.protocol import FrameError, recv_frame, send_frame, sign, verify
from worker.registration import InvalidRegistration, Registration
from worker.runfiles import RunFiles, write_run_files

logger = logging.getLogger(__name__)


class RegistrationRejected(RendezvousError):
    """The master refused a registration; the message is the master's reason."""


def _is_nonce(value: object) -> bool:
    return isinstance(value, str) and 16 <= len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


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


class _Handler(socketserver.StreamRequestHandler):
    """One worker's connection: authenticate, validate, record, then hold until release."""

    timeout = READ_TIMEOUT_S  # applied to the socket in setup(); reads also carry a per-frame deadline
    disable_nagle_algorithm = True

    server: "RendezvousServer"

    def setup(self) -> None:
        super().setup()
        self.server._connection_opened()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server._connection_closed()

    def handle(self) -> None:
        peer = self.client_address[0]
        server_nonce = secrets.token_hex(16)
        try:
            send_frame(self.connection, {"type": "hello", "version": PROTOCOL_VERSION, "nonce": server_nonce})
            message = recv_frame(self.connection, timeout=self.server.read_timeout)
        except FrameError as error:
            logger.info("connection from %s dropped before registering: %s", peer, error)
            return
        client_nonce = message.get("nonce")
        if message.get("type") != "register" or not _is_nonce(client_nonce):
            self._reply(server_nonce, "", "rejected", "expected a register message with a nonce")
            return
        worker = message.get("worker")
        if not verify(self.server.token, message.get("mac"), "register", server_nonce, client_nonce, worker):
            logger.warning("registration from %s refused: authentication failed", peer)
            self._reply(server_nonce, client_nonce, "rejected",
                        "authentication failed: the token does not match this run's; use the run's token file")
            return
        try:
            registration = Registration.from_dict(worker)
        except InvalidRegistration as error:
            logger.warning("registration from %s refused: %s", peer, error)
            self._reply(server_nonce, client_nonce, "rejected", str(error))
            return
        refusal = self.server._add(registration, self)
        if refusal:
            logger.warning("registration of %s refused: %s", registration.address, refusal)
            self._reply(server_nonce, client_nonce, "rejected", refusal)
            return
        if not self._reply(server_nonce, client_nonce, "accepted", ""):
            self.server._drop(registration, self)
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
        try:
            send_frame(self.connection, {"type": "released", "mac": sign(self.server.token, "released", server_nonce, client_nonce)})
        except FrameError as error:
            logger.info("could not release %s: %s", self.client_address[0], error)

    def _hold(self, registration: Registration, server_nonce: str, client_nonce: str) -> None:
        """Keep the connection until release, heartbeating; a worker that hangs up is dropped."""
        if self.server.released.is_set():  # released while this worker was still shaking hands
            self._send_release(server_nonce, client_nonce)
            return
        with selectors.DefaultSelector() as selector:
            selector.register(self.connection, selectors.EVENT_READ)
            selector.register(self.server._release_reader, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select(timeout=self.server.heartbeat)}
                try:
                    if self.server._release_reader in ready or self.server.released.is_set():
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
                    self.server._drop(registration, self, reason=str(error))
                    return


class RendezvousServer(socketserver.ThreadingTCPServer):
    """Collects ``expect`` authenticated registrations, then writes the run's files.

    Methods for the caller: :meth:`start` (serve in a thread), :meth:`wait`, :meth:`release`,
    :meth:`close` (all three on leaving a ``with`` block), :attr:`endpoint`, :attr:`workers`.
    """

    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False
    # A whole cluster connects at once: a shorter listen backlog drops connects that TCP retries ~1 s later.
    request_queue_size = MAX_CONNECTIONS
    #: Connections handled at once (one thread each); more are closed at accept.
    max_connections = MAX_CONNECTIONS

    def __init__(
        self,
        expect: int,
        token: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        files: RunFiles | None = None,
        identity_file: Path | None = None,
        read_timeout: float = READ_TIMEOUT_S,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        """
        :param expect: how many workers make the run complete.
        :param token: the per-run secret (never logged).
        :param host: address to listen on ("0.0.0.0" for pods on other machines).
        :param port: port to listen on; 0 lets the OS choose (see :attr:`endpoint`).
        :param files: where to write hostfile, known_hosts and ssh_config once complete (None: nowhere).
        :param identity_file: the run's ssh private key, named in ssh_config.
        :param read_timeout: seconds a connection has to send its registration.
        :param heartbeat: seconds between keepalives on held connections.
        """
        if isinstance(expect, bool) or not isinstance(expect, int) or not 1 <= expect <= MAX_EXPECTED_WORKERS:
            raise RendezvousError(f"expected worker count {expect!r} must be 1..{MAX_EXPECTED_WORKERS}; pass --expect")
        self.token = token.encode("utf-8") if isinstance(token, str) else bytes(token)
        if len(self.token) < 16:
            raise RendezvousError("the rendezvous token is shorter than 16 bytes; create one with secrets.token_urlsafe()")
        self.expect = expect
        self.files = files
        self.identity_file = identity_file
        self.read_timeout = read_timeout
        self.heartbeat = heartbeat
        self._lock = threading.Lock()
        self._by_address: dict[str, tuple[Registration, _Handler]] = {}
        self._complete = threading.Event()
        self._failure: Exception | None = None
        self._connections = 0
        self._idle = threading.Condition(self._lock)
        self.released = threading.Event()
        # Held connections select on this pair so a release wakes them at once, without polling.
        self._release_reader, self._release_writer = socket.socketpair()
        self._thread: threading.Thread | None = None
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            super().__init__((host, port), _Handler)
        except OSError as error:
            self._release_reader.close()
            self._release_writer.close()
            raise RendezvousError(f"cannot listen on {host}:{port}: {error.strerror}; pick another --port") from None

    @property
    def endpoint(self) -> tuple[str, int]:
        """The (host, port) actually bound.

        :rtype: tuple[str, int]
        """
        host, port = self.server_address[:2]
        return host, port

    @property
    def workers(self) -> list[Registration]:
        """Registrations so far, in node-rank order (by address).

        :rtype: list[Registration]
        """
        with self._lock:
            registrations = [registration for registration, _ in self._by_address.values()]
        return sorted(registrations, key=lambda r: ipaddress.ip_address(r.address))

    def start(self) -> "RendezvousServer":
        """Serve in a background thread.

        :rtype: RendezvousServer
        """
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="rendezvous", daemon=True)
        self._thread.start()
        logger.info("rendezvous listening on %s:%d for %d workers", *self.endpoint, self.expect)
        return self

    def verify_request(self, request, client_address) -> bool:
        with self._lock:
            if self._connections >= self.max_connections:
                logger.warning("refusing connection from %s: %d connections open", client_address[0], self._connections)
                return False
        return True

    def handle_error(self, request, client_address) -> None:
        logger.exception("rendezvous handler for %s failed", client_address[0])

    def _connection_opened(self) -> None:
        with self._lock:
            self._connections += 1

    def _connection_closed(self) -> None:
        with self._lock:
            self._connections -= 1
            self._idle.notify_all()

    def _add(self, registration: Registration, handler: _Handler) -> str:
        """Record a registration; the refusal reason, or "" when accepted."""
        with self._lock:
            existing = self._by_address.get(registration.address)
            if existing and (existing[0].host_key, existing[0].pod) == (registration.host_key, registration.pod):
                # The same worker again (it lost our reply and retried): the newer connection wins.
                self._by_address[registration.address] = (registration, handler)
                return ""
            if existing:
                return (f"address {registration.address} is already registered by pod {existing[0].pod!r}; "
                        "each worker needs its own address")
            same_pod = [r for r, _ in self._by_address.values() if r.pod == registration.pod]
            if same_pod:
                return f"pod {registration.pod!r} is already registered from {same_pod[0].address}"
            if self._complete.is_set():
                return f"the run is full: {self.expect} of {self.expect} workers registered"
            self._by_address[registration.address] = (registration, handler)
            count = len(self._by_address)
            logger.info("registered %s (pod %s, %d slots) %d/%d",
                        registration.address, registration.pod, registration.slots, count, self.expect)
            if count == self.expect:
                self._finish()
        return ""

    def _finish(self) -> None:
        """All workers are in: write the run's files (under the lock, so no one joins or leaves meanwhile)."""
        ordered = sorted((r for r, _ in self._by_address.values()), key=lambda r: ipaddress.ip_address(r.address))
        try:
            if self.files is not None:
                write_run_files(self.files, ordered, self.identity_file)
        except Exception as error:  # reported by wait(), which the caller is blocked in
            self._failure = error
        self._complete.set()

    def _drop(self, registration: Registration, handler: _Handler, reason: str = "") -> None:
        with self._lock:
            current = self._by_address.get(registration.address)
            if current is None or current[1] is not handler:
                return
            if self._complete.is_set():
                logger.warning("worker %s (pod %s) disconnected during the run: %s",
                               registration.address, registration.pod, reason)
                return
            del self._by_address[registration.address]
        logger.warning("worker %s (pod %s) left before the run was complete: %s",
                       registration.address, registration.pod, reason)

    def wait(self, timeout: float, expected_pods: Iterable[str] | None = None,
             check: Callable[[], None] | None = None, total: float | None = None) -> list[Registration]:
        """Block until ``expect`` workers registered and the files are written.

        :param timeout: seconds to wait.
        :param expected_pods: names of launched pods, to say which ones are missing.
        :param check: called about twice a second; raise from it to stop waiting (a pod died).
        :param total: the whole start's timeout, for the error message (default: ``timeout``).
        :rtype: list[Registration]
        :raises RendezvousError: one line naming how many came and which are missing.
        """
        deadline = time.monotonic() + timeout
        while not self._complete.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                raise RendezvousError(self._missing_message(timeout if total is None else total, expected_pods))
        if self._failure is not None:
            raise RendezvousError(f"all {self.expect} workers registered but the run files could not be written: {self._failure}")
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
        return message + "; check the workers' logs, the token and that they can reach this address, or raise the timeout"

    def release(self) -> None:
        """Tell every held worker it is released (they stop sshd and exit)."""
        self.released.set()
        try:
            self._release_writer.send(b"r")
        except OSError:
            pass

    def close(self, drain_s: float = 2.0) -> None:
        """Release workers, stop serving, close the sockets. Safe to call twice.

        :param drain_s: seconds to let handlers deliver the release before their sockets are closed.
        """
        self.release()
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        with self._lock:
            self._idle.wait_for(lambda: self._connections == 0, timeout=drain_s)
        self.server_close()
        self._release_reader.close()
        self._release_writer.close()

    def __enter__(self) -> "RendezvousServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


class Session:
    """A worker's accepted registration: the open connection it waits for its release on."""

    def __init__(self, sock: socket.socket, token: bytes, server_nonce: str, client_nonce: str) -> None:
        self._sock = sock
        self._token = token
        self._nonces = (server_nonce, client_nonce)

    def wait_released(self, gone_after: float = MASTER_GONE_AFTER_S) -> bool:
        """Block (no polling) until released or the master is gone.

        :param gone_after: seconds without any frame after which the master counts as gone.
        :rtype: bool
        :returns: True when the master released this worker, False when it went away.
        """
        while True:
            try:
                message = recv_frame(self._sock, timeout=gone_after)
            except FrameError as error:
                logger.info("master gone: %s", error)
                return False
            if message.get("type") == "released":
                if verify(self._token, message.get("mac"), "released", *self._nonces):
                    return True
                logger.warning("ignoring a release that is not signed with the run's token")

    def detach(self) -> None:
        """Leave the registration in place without holding the connection (``textsql rendezvous register``)."""
        try:
            send_frame(self._sock, {"type": "detach"})
        finally:
            self._sock.close()

    def close(self) -> None:
        """Close the connection; before the run is complete the master then drops this worker."""
        self._sock.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def register(master: str | tuple[str, int], token: str | bytes, registration: Registration,
             timeout: float = READ_TIMEOUT_S) -> Session:
    """Register one worker with the master's rendezvous server.

    :param master: ``HOST:PORT`` or (host, port).
    :param token: the per-run secret.
    :param registration: this worker's fields.
    :param timeout: seconds for connecting and for each reply.
    :rtype: Session
    :raises RegistrationRejected: with the master's reason (not worth retrying).
    :raises FrameError: or OSError when the master could not be reached or hung up (worth retrying).
    """
    host, port = parse_endpoint(master) if isinstance(master, str) else master
    token = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = recv_frame(sock, timeout=timeout)
        server_nonce = hello.get("nonce")
        if hello.get("type") != "hello" or not _is_nonce(server_nonce):
            raise FrameError(f"{host}:{port} is not a textsql rendezvous server")
        if hello.get("version") != PROTOCOL_VERSION:
            raise RegistrationRejected(f"master {host}:{port} speaks rendezvous protocol {hello.get('version')!r}, "
                                       f"this worker {PROTOCOL_VERSION}; run the same textsql version on both")
        client_nonce = secrets.token_hex(16)
        worker = registration.to_dict()
        send_frame(sock, {"type": "register", "nonce": client_nonce, "worker": worker,
                          "mac": sign(token, "register", server_nonce, client_nonce, worker)}, timeout=timeout)
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


def register_until(master: tuple[str, int], token: str, registration: Registration, deadline_s: float) -> Session:
    """Register, retrying unreachable masters with jittered exponential backoff until ``deadline_s``.

    :param master: (host, port) of the rendezvous.
    :param token: the per-run secret.
    :param registration: this worker.
    :param deadline_s: seconds to keep trying.
    :rtype: Session
    :raises RegistrationRejected: at once when the master refuses (retrying would not help).
    :raises RendezvousError: when the deadline passes.
    """
    deadline = time.monotonic() + deadline_s
    delay = BACKOFF_START_S
    while True:
        try:
            return register(master, token, registration)
        except RegistrationRejected:
            raise
        except (FrameError, OSError) as error:
            if time.monotonic() + delay > deadline:
                raise RendezvousError(f"could not register with {master[0]}:{master[1]} within {deadline_s:g}s: {error}") from None
            logger.info("master %s:%d not reachable yet (%s); retrying in %.1fs", *master, error, delay)
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, BACKOFF_MAX_S)


def read_token(path: Path) -> str:
    """The token from a token file, refusing files others can read.

    :param path: the token file.
    :rtype: str
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise RendezvousError(f"cannot read token file {str(path)!r}: {error.strerror}; pass --token-file") from None
    if mode & 0o077:
        raise RendezvousError(f"token file {str(path)!r} is readable by others; chmod 600 it")
    if len(token) < 16:
        raise RendezvousError(f"token file {str(path)!r} holds no usable token (under 16 characters)")
    return token


def new_token(path: Path) -> str:
    """Create a per-run token file (mode 0600) and return the token.

    :param path: where to write it.
    :rtype: str
    """
    token = secrets.token_urlsafe(32)
    atomic_write(Path(path), token + "\n", mode=0o600)
    return token


def serve(expect: int, token_file: Path, hostfile: Path, timeout: float, host: str = "0.0.0.0",
          port: int | None = None, identity_file: Path | None = None, hold: bool = False) -> list[Registration]:
    """``textsql rendezvous serve``: wait for ``expect`` workers, write hostfile, known_hosts, ssh_config.

    known_hosts and ssh_config go beside the hostfile. A missing token file is created (0600).

    :param expect: number of workers.
    :param token_file: the per-run token file.
    :param hostfile: where the DeepSpeed hostfile goes.
    :param timeout: seconds to wait for all workers.
    :param host: address to listen on.
    :param port: port to listen on (0: any; None: ``DEFAULT_RENDEZVOUS_PORT``).
    :param identity_file: the private key ssh_config names (default: id_ed25519 beside the hostfile).
    :param hold: keep holding the workers' connections after writing the files, until interrupted.
    :rtype: list[Registration]
    """
    hostfile = Path(hostfile).resolve()
    hostfile.parent.mkdir(parents=True, exist_ok=True)
    token_file = Path(token_file)
    token = read_token(token_file) if token_file.exists() else new_token(token_file)
    siblings = RunFiles.in_dir(hostfile.parent)
    files = RunFiles(hostfile, siblings.known_hosts, siblings.ssh_config)
    port = DEFAULT_RENDEZVOUS_PORT if port is None else port
    with RendezvousServer(expect=expect, token=token, host=host, port=port, files=files,
                          identity_file=identity_file or hostfile.parent / IDENTITY_NAME) as server:
        workers = server.wait(timeout)
        if hold:
            logger.info("holding %d workers until interrupted", len(workers))
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                logger.info("releasing workers")
    return workers


def register_once(master: str, token_file: Path, registration: Registration, timeout: float,
                  wait: bool = False) -> bool:
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
