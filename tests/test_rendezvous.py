"""The rendezvous over real TCP sockets: authentication, validation, bounded reads, concurrency, files."""

from __future__ import annotations

import base64
import os
import secrets
import socket
import struct
import threading
import time

import pytest

from worker.constants import PROTOCOL_VERSION, RELEASE_HANGUP_S
from worker.errors import RendezvousError
from worker.protocol import FrameError, recv_frame, send_frame, sign
from worker.registration import Registration
from worker.rendezvous.client import RegistrationRejected, register
from worker.rendezvous.server import RendezvousServer
from worker.rendezvous.token import new_token, pod_key, read_token
from worker.runfiles import RunFiles

TOKEN = secrets.token_urlsafe(32)


def host_key(seed: int) -> str:
    """A well-formed ssh-ed25519 public key (the blob layout of a real one)."""
    blob = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32) + seed.to_bytes(32, "big")
    return f"ssh-ed25519 {base64.b64encode(blob).decode()}"


def worker(i: int, **changes) -> Registration:
    fields = {
        "address": f"10.0.{i // 250}.{i % 250 + 1}",
        "slots": 1 + i % 4,
        "hostname": f"pod-{i}",
        "pod": f"pod-{i}",
        "ssh_port": 2222,
        "host_key": host_key(i),
        "user": "cdsw",
    }
    fields.update(changes)
    return Registration(**fields)


@pytest.fixture
def files(tmp_path) -> RunFiles:
    return RunFiles.in_dir(tmp_path)


def test_32_concurrent_registrations_write_exact_files(files, tmp_path):
    identity = tmp_path / "id_ed25519"
    sessions, errors = [], []

    def join(i):
        try:
            sessions.append(register(server.endpoint, TOKEN, worker(i)))
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    with RendezvousServer(expect=32, token=TOKEN, files=files, identity_file=identity) as server:
        threads = [threading.Thread(target=join, args=(i,)) for i in reversed(range(32))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        workers = server.wait(timeout=30)
        assert [w.pod for w in workers] == [f"pod-{i}" for i in range(32)]
        released = [None] * 32

        def wait_release(i):
            released[i] = sessions[i].wait_released()

        waiters = [threading.Thread(target=wait_release, args=(i,)) for i in range(32)]
        for thread in waiters:
            thread.start()
    for thread in waiters:
        thread.join(timeout=10)
    assert released == [True] * 32

    expected_hosts = "".join(f"10.0.0.{i + 1} slots={1 + i % 4}\n" for i in range(32))
    assert files.hostfile.read_text() == expected_hosts
    assert files.known_hosts.read_text() == "".join(f"[10.0.0.{i + 1}]:2222 {host_key(i)}\n" for i in range(32))
    config = files.ssh_config.read_text()
    assert config.startswith(
        "Host 10.0.0.1\n    HostName 10.0.0.1\n    Port 2222\n    User cdsw\n"
        f'    IdentityFile "{identity}"\n    IdentitiesOnly yes\n'
        f'    UserKnownHostsFile "{files.known_hosts}"\n'
    )
    assert config.count("StrictHostKeyChecking yes") == 32 and "BatchMode yes" in config
    assert TOKEN not in expected_hosts + files.known_hosts.read_text() + config


def test_close_returns_once_released_workers_have_hung_up(files, tmp_path):
    # The backend stops pods right after close(): a worker stopped before it has taken its release is
    # killed instead of shutting down by itself (its log never says "released", CI saw it). A worker
    # that never hangs up costs the master RELEASE_HANGUP_S, no more.
    hung_up = []

    def hold(session, shutdown_s):
        with session:
            assert session.wait_released()
            time.sleep(shutdown_s)  # the worker's own shutdown before it closes the connection
            # recorded before the hang-up: the master may return the instant it sees the close
            hung_up.append(shutdown_s)

    with RendezvousServer(expect=2, token=TOKEN, files=files, identity_file=tmp_path / "id_ed25519") as server:
        sessions = [register(server.endpoint, TOKEN, worker(i)) for i in range(2)]
        server.wait(timeout=30)
        threads = [threading.Thread(target=hold, args=(session, delay)) for session, delay in zip(sessions, (0.0, 0.3))]
        for thread in threads:
            thread.start()
    assert sorted(hung_up) == [0.0, 0.3]

    with RendezvousServer(expect=1, token=TOKEN, files=files, identity_file=tmp_path / "id_ed25519") as server:
        session = register(server.endpoint, TOKEN, worker(0))
        server.wait(timeout=30)
        started = time.monotonic()
    assert time.monotonic() - started < RELEASE_HANGUP_S + 5  # bounded: not until the read timeout
    session.close()


def test_port_22_known_hosts_line_is_bare(files):
    with RendezvousServer(expect=1, token=TOKEN, files=files) as server:
        register(server.endpoint, TOKEN, worker(0, ssh_port=22)).close()
        server.wait(timeout=10)
    assert files.known_hosts.read_text() == f"10.0.0.1 {host_key(0)}\n"


def test_wrong_token_is_refused_with_a_reason(files):
    with RendezvousServer(expect=1, token=TOKEN, files=files) as server:
        with pytest.raises(RegistrationRejected, match="authentication failed.*not signed with this token"):
            register(server.endpoint, secrets.token_urlsafe(32), worker(0))
        assert server.workers == []
    assert not files.hostfile.exists()


def raw_connection(server: RendezvousServer) -> socket.socket:
    sock = socket.create_connection(server.endpoint, timeout=10)
    assert recv_frame(sock)["type"] == "hello"
    return sock


def closed_by_server(sock: socket.socket, within: float = 10) -> bool:
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (TimeoutError, ConnectionResetError):
        return False


@pytest.mark.parametrize(
    "payload",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # garbage: its first 4 bytes read as a huge length
        struct.pack(">I", 10_000_000) + b"{",  # oversized length prefix, refused unread
        struct.pack(">I", 5) + b"[1,2]",  # JSON, but not an object
        struct.pack(">I", 4) + b"\xff\xfe\xfd\xfc",  # not UTF-8
    ],
)
def test_bad_frames_close_the_connection_and_others_still_register(files, payload):
    with RendezvousServer(expect=1, token=TOKEN, files=files) as server:
        sock = raw_connection(server)
        sock.sendall(payload)
        assert closed_by_server(sock)
        sock.close()
        register(server.endpoint, TOKEN, worker(0)).close()
        assert len(server.wait(timeout=10)) == 1


def test_truncated_frame_is_dropped(files):
    with RendezvousServer(expect=1, token=TOKEN, files=files) as server:
        sock = raw_connection(server)
        sock.sendall(struct.pack(">I", 200) + b'{"type": "register"')
        sock.shutdown(socket.SHUT_WR)
        assert closed_by_server(sock)
        sock.close()
        assert server.workers == []


def test_silent_and_dripping_connections_do_not_block_others(files):
    with RendezvousServer(expect=3, token=TOKEN, files=files, read_timeout=30) as server:
        silent = raw_connection(server)
        held = [register(server.endpoint, TOKEN, worker(i)) for i in range(3)]
        assert len(server.wait(timeout=20)) == 3  # completed while the silent one is still held open
        for connection in [silent, *held]:
            connection.close()

    with RendezvousServer(expect=1, token=TOKEN, files=None, read_timeout=1) as server:
        drip = raw_connection(server)
        drip.sendall(struct.pack(">I", 100))
        sent = 0
        for sent in range(20):  # one byte every 0.2 s: 4 s for 20 bytes, against a 1 s deadline per frame
            try:
                drip.sendall(b" ")
            except OSError:
                break
            time.sleep(0.2)
        # Cut off while still dripping: a timeout per read (reset by every byte) would let all 20 through.
        assert sent < 19
        assert closed_by_server(drip)
        drip.close()


def test_duplicates_are_refused_and_an_accepted_registration_is_immutable(files):
    with RendezvousServer(expect=2, token=TOKEN, files=files) as server:
        first = register(server.endpoint, TOKEN, worker(0))
        with pytest.raises(RegistrationRejected, match="address 10.0.0.1 is already registered by pod 'pod-0'"):
            register(server.endpoint, TOKEN, worker(1, address="10.0.0.1"))
        with pytest.raises(RegistrationRejected, match="pod 'pod-0' is already registered from 10.0.0.1"):
            register(server.endpoint, TOKEN, worker(0, address="10.0.0.9"))
        # The very same fields again (what a hijacker of a live worker sends): refused, the first connection kept.
        with pytest.raises(RegistrationRejected, match="an accepted registration cannot be changed"):
            register(server.endpoint, TOKEN, worker(0))
        assert server.workers == [worker(0)]
        register(server.endpoint, TOKEN, worker(1)).close()
        assert [w.address for w in server.wait(timeout=10)] == ["10.0.0.1", "10.0.0.2"]
        with pytest.raises(RegistrationRejected, match="the run is full: 2 of 2"):
            register(server.endpoint, TOKEN, worker(2))
        first.close()


def test_each_pod_key_registers_its_own_pod_only(files):
    """A pod's key (all a launched pod receives) proves its own name: signing another pod's registration fails."""
    with RendezvousServer(expect=2, token=TOKEN, files=files) as server:
        first = register(server.endpoint, pod_key(TOKEN, "pod-0"), worker(0))
        with pytest.raises(RegistrationRejected, match="authentication failed"):
            register(server.endpoint, pod_key(TOKEN, "pod-0"), worker(1))
        register(server.endpoint, pod_key(TOKEN, "pod-1"), worker(1)).close()
        assert [w.pod for w in server.wait(timeout=10)] == ["pod-0", "pod-1"]
        first.close()


def test_a_registration_must_come_from_the_address_it_names(files):
    """With check_peer (the launching backends), the registered address is the connection's source address."""
    with RendezvousServer(expect=1, token=TOKEN, files=files, check_peer=True) as server:
        with pytest.raises(RegistrationRejected, match=r"is not the address this registration came from \(127.0.0.1\)"):
            register(server.endpoint, TOKEN, worker(0))
        register(server.endpoint, TOKEN, worker(0, address="127.0.0.5"), source="127.0.0.5").close()
        assert [w.address for w in server.wait(timeout=10)] == ["127.0.0.5"]


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"address": "not-an-ip"}, "address 'not-an-ip' is not an IP address"),
        ({"address": "0.0.0.0"}, "cannot be reached"),
        ({"slots": 0}, "slots 0 must be an integer from 1 to 16"),
        ({"slots": 99}, "slots 99 must be"),
        ({"slots": "2"}, "slots '2' must be"),
        ({"ssh_port": 70000}, "ssh port 70000"),
        ({"hostname": "bad host;rm"}, "hostname 'bad host;rm' is not a valid hostname"),
        ({"host_key": "ssh-ed25519 !!!"}, "not a valid OpenSSH public key"),
        ({"host_key": "ssh-dss AAAA"}, "type 'ssh-dss' is not one of"),
        ({"host_key": host_key(1).replace("ssh-ed25519", "ssh-rsa")}, "holds a 'ssh-ed25519' key but says 'ssh-rsa'"),
        ({"host_key": None}, "ssh_port and host_key go together"),
        ({"user": "root\nHost *"}, "user 'root\\\\nHost \\*' is not a valid login name"),
    ],
)
def test_invalid_fields_are_refused_naming_the_field(files, changes, reason):
    with RendezvousServer(expect=1, token=TOKEN, files=files) as server:
        with pytest.raises(RegistrationRejected, match=reason):
            register(server.endpoint, TOKEN, worker(0, **changes))
        assert server.workers == []


def test_unknown_fields_are_refused(files):
    with RendezvousServer(expect=1, token=TOKEN, files=files) as server:
        sock = socket.create_connection(server.endpoint, timeout=10)
        nonce = recv_frame(sock)["nonce"]
        body = dict(worker(0).to_dict(), command="rm -rf /")
        send_frame(
            sock,
            {
                "type": "register",
                "nonce": "ab" * 16,
                "worker": body,
                "mac": sign(pod_key(TOKEN, "pod-0").encode(), "register", nonce, "ab" * 16, body),
            },
        )
        assert recv_frame(sock)["reason"] == "unknown registration field 'command'"
        sock.close()


def test_missing_worker_names_the_pod_and_writes_nothing(files):
    with RendezvousServer(expect=3, token=TOKEN, files=files) as server:
        held = [register(server.endpoint, TOKEN, worker(i)) for i in range(2)]
        with pytest.raises(RendezvousError, match=r"^only 2 of 3 workers registered within 1s; missing: pod-2;"):
            server.wait(timeout=1, expected_pods=["pod-0", "pod-1", "pod-2"])
        for session in held:
            session.close()
    assert not any(path.exists() for path in (files.hostfile, files.known_hosts, files.ssh_config))


def test_worker_that_leaves_before_completion_is_dropped(files):
    with RendezvousServer(expect=2, token=TOKEN, files=files, heartbeat=0.2) as server:
        register(server.endpoint, TOKEN, worker(0)).close()
        deadline = time.monotonic() + 10
        while server.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.workers == []


def test_worker_sees_the_master_go_away():
    # A master that accepts, then vanishes: the worker's wait returns False instead of hanging.
    listener = socket.create_server(("127.0.0.1", 0))
    registration = worker(0)

    def vanishing_master():
        conn, _ = listener.accept()
        send_frame(conn, {"type": "hello", "version": PROTOCOL_VERSION, "nonce": "cd" * 16})
        message = recv_frame(conn)
        send_frame(
            conn,
            {
                "type": "accepted",
                "reason": "",
                "mac": sign(pod_key(TOKEN, "pod-0").encode(), "accepted", "cd" * 16, message["nonce"], ""),
            },
        )
        conn.close()

    thread = threading.Thread(target=vanishing_master)
    thread.start()
    with register(listener.getsockname(), TOKEN, registration) as session:
        assert session.wait_released(gone_after=30) is False
    thread.join()
    listener.close()


def test_silence_from_the_master_counts_as_gone(files):
    with (
        RendezvousServer(expect=1, token=TOKEN, files=files, heartbeat=60) as server,
        register(server.endpoint, TOKEN, worker(0)) as session,
    ):
        assert session.wait_released(gone_after=0.5) is False


def test_token_file_is_private(tmp_path):
    path = tmp_path / "token"
    token = new_token(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_token(path) == token
    os.chmod(path, 0o644)
    with pytest.raises(RendezvousError, match="readable by others; chmod 600"):
        read_token(path)


def test_frame_helpers_refuse_oversized_messages():
    with pytest.raises(FrameError, match="exceeds the 16384-byte frame limit"):
        send_frame(socket.socket(), {"x": "y" * 20000})


def test_connections_over_the_limit_are_closed_at_accept(files):
    with RendezvousServer(expect=1, token=TOKEN, files=files, read_timeout=30) as server:
        server.max_connections = 2
        held = [raw_connection(server) for _ in range(2)]
        extra = socket.create_connection(server.endpoint, timeout=10)
        assert extra.recv(4) == b""  # closed without a hello
        extra.close()
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while True:  # the held handlers notice the close, then there is room again
            try:
                register(server.endpoint, TOKEN, worker(0)).close()
                break
            except FrameError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert len(server.wait(timeout=10)) == 1


def test_a_master_of_another_protocol_version_is_refused():
    listener = socket.create_server(("127.0.0.1", 0))

    def future_master():
        conn, _ = listener.accept()
        send_frame(conn, {"type": "hello", "version": 99, "nonce": "ef" * 16})
        conn.close()

    thread = threading.Thread(target=future_master)
    thread.start()
    with pytest.raises(
        RegistrationRejected,
        match=f"speaks rendezvous protocol 99, this worker {PROTOCOL_VERSION}; run the same textsql version",
    ):
        register(listener.getsockname(), TOKEN, worker(0))
    thread.join()
    listener.close()
