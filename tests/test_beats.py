"""A rank's heartbeat on its own pod's channel (worker/beats.py): from the rank to its agent's local socket, from the
agent to the master on its held rendezvous connection, signed with the pod's key; and what a relay that is forged,
replayed or from a worker given up gets."""

from __future__ import annotations

import secrets
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from worker.beats import Beat, BeatInbox, InvalidBeats, beats_from_wire, decode_beat, encode_beat, send_beat
from worker.constants import MAX_SLOTS
from worker.errors import WorkerError
from worker.protocol import new_nonce, recv_frame, send_frame, sign
from worker.registration import Registration
from worker.rendezvous.client import register
from worker.rendezvous.server import RendezvousServer
from worker.rendezvous.token import pod_key
from worker.runfiles import RunFiles

TOKEN = secrets.token_urlsafe(32)


def registration(index: int) -> Registration:
    return Registration(address=f"10.0.0.{index + 1}", slots=1, hostname=f"pod-{index}", pod=f"pod-{index}")


def test_a_beat_reads_back_and_nothing_else_is_one():
    assert decode_beat(encode_beat(Beat(rank=3, step=40, progress=41))) == Beat(3, 40, 41)
    for datagram in [
        b"",
        b"1 2",
        b"1 2 3 4",
        b"-1 2 3",
        b"1 2 3\n",
        b"1  2 3",
        "\u0661 2 3".encode(),
        b"9" * 16 + b" 1 1",
    ]:
        assert decode_beat(datagram) is None, datagram


def test_the_agents_inbox_keeps_each_ranks_newest_beat_in_a_directory_of_its_own():
    with BeatInbox() as inbox:
        assert stat.S_IMODE(inbox.directory.stat().st_mode) == 0o700
        for progress in (1, 2, 3):
            assert send_beat(inbox.path, Beat(0, progress, progress))
        assert send_beat(inbox.path, Beat(1, 7, 7))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
            other.sendto(b"$(rm -rf ~)", inbox.path)
        assert sorted(inbox.drain()) == [Beat(0, 3, 3), Beat(1, 7, 7)]
        assert inbox.drain() == []
    assert not inbox.directory.exists()
    # With no agent listening, a rank's heartbeat is simply not sent: the rank goes on.
    assert send_beat(inbox.path, Beat(0, 4, 4)) is False


def test_an_inbox_that_cannot_open_says_how_to_fix_it(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(WorkerError, match="heartbeat socket .*; set TMPDIR to a short local directory"):
        BeatInbox()
    assert list(deep.iterdir()) == [], "its directory is removed"


@pytest.mark.parametrize(
    "wire",
    [
        "0 1 2",
        [[0, 1]],
        [[True, 1, 2]],
        [[-1, 1, 2]],
        [["0", 1, 2]],
        [[0, 1, 2.0]],
        [[0, 1, 10**16]],
        [[0, 1, 2]] * (MAX_SLOTS + 1),
    ],
)
def test_a_relayed_frames_beats_are_checked(wire):
    assert beats_from_wire([[0, 1, 2], [1, 1, 2]]) == [Beat(0, 1, 2), Beat(1, 1, 2)]
    with pytest.raises(InvalidBeats):
        beats_from_wire(wire)


def wait_for(condition, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_held_agent_relays_its_ranks_beats_under_the_address_it_registered(tmp_path: Path):
    received: list[tuple[str, Beat]] = []
    with RendezvousServer(expect=1, token=TOKEN, files=RunFiles.in_dir(tmp_path)) as server, BeatInbox() as inbox:
        server.beats_to = lambda address, beat: received.append((address, beat))
        with register(server.endpoint, pod_key(TOKEN, "pod-0"), registration(0)) as session:
            released: list[bool] = []
            waiting = threading.Thread(target=lambda: released.append(session.wait_released(beats=inbox)))
            waiting.start()
            send_beat(inbox.path, Beat(0, 5, 9))
            assert wait_for(lambda: received), "the beat never reached the master"
            send_beat(inbox.path, Beat(0, 6, 10))
            assert wait_for(lambda: len(received) == 2)
            server.release()
            waiting.join(timeout=10)
    assert released == [True]
    assert received == [("10.0.0.1", Beat(0, 5, 9)), ("10.0.0.1", Beat(0, 6, 10))]


class HeldWorker:
    """A worker's held connection spoken by hand, to send the frames an honest agent never would."""

    def __init__(self, server: RendezvousServer, index: int) -> None:
        self.key = pod_key(TOKEN, f"pod-{index}").encode()
        self.sock = socket.create_connection(server.endpoint, timeout=10)
        self.server_nonce, self.client_nonce = recv_frame(self.sock)["nonce"], new_nonce()
        worker = registration(index).to_dict()
        mac = sign(self.key, "register", self.server_nonce, self.client_nonce, worker)
        send_frame(self.sock, {"type": "register", "nonce": self.client_nonce, "worker": worker, "mac": mac})
        assert recv_frame(self.sock)["type"] == "accepted"

    def relay(self, sequence: int, beats: list[list[int]], key: bytes | None = None) -> None:
        mac = sign(key or self.key, "beats", self.server_nonce, self.client_nonce, sequence, beats)
        send_frame(self.sock, {"type": "beats", "sequence": sequence, "beats": beats, "mac": mac})

    def dropped(self) -> bool:
        """Whether the master hung up (its keepalives read until then)."""
        self.sock.settimeout(10)
        try:
            while recv_frame(self.sock, timeout=10):
                pass
        except Exception:  # noqa: BLE001 - a close or a reset, as the master drops it
            return True
        return False


@pytest.mark.parametrize("forgery", ["another pod's key", "a replayed sequence number", "no mac"])
def test_a_relay_not_signed_for_this_connection_drops_the_worker_and_is_never_believed(tmp_path: Path, forgery):
    received: list[tuple[str, Beat]] = []
    with RendezvousServer(expect=2, token=TOKEN, files=RunFiles.in_dir(tmp_path), heartbeat=0.2) as server:
        server.beats_to = lambda address, beat: received.append((address, beat))
        hostile, honest = HeldWorker(server, 0), HeldWorker(server, 1)
        hostile.relay(1, [[0, 1, 1]])
        assert wait_for(lambda: received == [("10.0.0.1", Beat(0, 1, 1))])
        if forgery == "another pod's key":
            hostile.relay(2, [[1, 900, 900]], key=honest.key)
        elif forgery == "a replayed sequence number":
            hostile.relay(1, [[0, 2, 2]])
        else:
            send_frame(hostile.sock, {"type": "beats", "sequence": 2, "beats": [[0, 3, 3]]})
        assert hostile.dropped()
        honest.relay(1, [[1, 1, 1]])
        assert wait_for(lambda: len(received) == 2)
        honest.sock.close()
    assert received == [("10.0.0.1", Beat(0, 1, 1)), ("10.0.0.2", Beat(1, 1, 1))]


def test_a_worker_given_up_speaks_for_its_address_no_more(tmp_path: Path):
    received: list[tuple[str, Beat]] = []
    with RendezvousServer(expect=1, token=TOKEN, files=RunFiles.in_dir(tmp_path), heartbeat=0.2) as server:
        server.beats_to = lambda address, beat: received.append((address, beat))
        worker = HeldWorker(server, 0)
        server.wait(timeout=10)
        server.reopen("10.0.0.1")  # its replacement may register at the same address
        worker.relay(1, [[0, 1, 1]])
        send_frame(worker.sock, {"type": "shutdown"})  # dropped for it, so the relay before it was read
        assert worker.dropped()
    assert received == []
