"""A rank's heartbeat on its own pod's channel (worker/beats.py): from the rank to its agent's local socket, from the
agent to the master on its held rendezvous connection, signed with the pod's key; and what a relay that is forged,
replayed or from a worker given up gets."""

from __future__ import annotations

import contextlib
import secrets
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from worker.beats import Beat, BeatInbox, InvalidBeats, beats_from_wire, decode_beat, encode_beat, send_beat
from worker.constants import MAX_RELAYED_FRAME_BYTES, MAX_SLOTS, RELAYED_FRAMES_BURST, RELAYED_FRAMES_PER_S
from worker.errors import WorkerError
from worker.protocol import encode_frame, new_nonce, recv_frame, send_frame, sign
from worker.registration import Registration
from worker.rendezvous.client import register
from worker.rendezvous.server import RendezvousServer
from worker.rendezvous.token import pod_key
from worker.runfiles import RunFiles

TOKEN = secrets.token_urlsafe(32)
# The largest count a heartbeat carries (15 digits, as a rank's datagram may hold).
_LARGEST_COUNT = 10**15 - 1


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

    def frame(self, sequence: int, beats: list[list[int]], key: bytes | None = None, **unsigned: object) -> dict:
        """A heartbeat frame signed with ``key`` (the pod's own by default), with ``unsigned`` fields beside."""
        mac = sign(key or self.key, "beats", self.server_nonce, self.client_nonce, sequence, beats)
        return {"type": "beats", "sequence": sequence, "beats": beats, "mac": mac, **unsigned}

    def relay(self, sequence: int, beats: list[list[int]], key: bytes | None = None, **unsigned: object) -> None:
        send_frame(self.sock, self.frame(sequence, beats, key, **unsigned))

    def dropped(self, within_s: float = 10.0) -> bool:
        """Whether the master hung up within ``within_s`` (its keepalives read until then)."""
        deadline = time.monotonic() + within_s
        try:
            while time.monotonic() < deadline:
                recv_frame(self.sock, timeout=within_s)
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


def test_the_largest_heartbeat_frame_an_agent_sends_fits_the_relayed_frame_limit():
    largest = [[_LARGEST_COUNT] * 3] * MAX_SLOTS
    mac = sign(b"k" * 32, "beats", new_nonce(), new_nonce(), 10**12, largest)
    frame = encode_frame({"type": "beats", "sequence": 10**12, "beats": largest, "mac": mac})
    assert len(frame) - 4 <= MAX_RELAYED_FRAME_BYTES


@pytest.mark.parametrize("padding", [[0] * 4096, "x"], ids=["8 KiB of numbers", "one letter"])
def test_a_relayed_frame_with_more_than_its_signed_fields_drops_the_worker(tmp_path: Path, padding):
    """A pod signs its heartbeat frames with its own key and pads them with fields the signature does not cover: the
    master parsed every one (8 KiB of numbers, 556 frames a second took 80 % of a core). A frame larger than any
    heartbeat frame is refused by its length prefix, unread; padding that fits is refused once read. Either drops the
    worker, and its beats are never believed."""
    received: list[tuple[str, Beat]] = []
    with RendezvousServer(expect=2, token=TOKEN, files=RunFiles.in_dir(tmp_path), heartbeat=0.2) as server:
        server.beats_to = lambda address, beat: received.append((address, beat))
        hostile, honest = HeldWorker(server, 0), HeldWorker(server, 1)
        hostile.relay(1, [[0, 1, 1]], padding=padding)
        assert hostile.dropped(within_s=3)
        honest.relay(1, [[1, 1, 1]])
        assert wait_for(lambda: received)
        honest.sock.close()
    assert received == [("10.0.0.2", Beat(1, 1, 1))]


def test_a_flood_of_signed_relayed_frames_is_read_no_faster_than_the_rate(tmp_path: Path):
    """A pod floods well-formed heartbeat frames, signed with its own key, as fast as loopback takes them: the master
    reads its burst, then RELAYED_FRAMES_PER_S a second (the rest wait unread in TCP's buffers, and the flood's sends
    block), while another pod's beat is taken at once. Before, the master read and checked every frame it was sent."""
    received: list[tuple[str, Beat]] = []
    with RendezvousServer(expect=2, token=TOKEN, files=RunFiles.in_dir(tmp_path), heartbeat=0.2) as server:
        server.beats_to = lambda address, beat: received.append((address, beat))
        hostile, honest = HeldWorker(server, 0), HeldWorker(server, 1)
        sent = [0]

        def flood() -> None:
            hostile.sock.settimeout(None)
            with contextlib.suppress(OSError):
                for sequence in range(1, 100_000):
                    hostile.sock.sendall(encode_frame(hostile.frame(sequence, [[0, sequence, sequence]])))
                    sent[0] = sequence

        flooding = threading.Thread(target=flood, daemon=True)
        started = time.monotonic()
        flooding.start()
        time.sleep(2)
        honest.relay(1, [[1, 1, 1]])
        assert wait_for(lambda: ("10.0.0.2", Beat(1, 1, 1)) in received, within=2)
        elapsed, flooded = time.monotonic() - started, sum(address == "10.0.0.1" for address, _ in received)
        hostile.sock.shutdown(socket.SHUT_RDWR)
        flooding.join(timeout=10)
    assert sent[0] > flooded, "the flood outran what the master reads"
    assert flooded <= RELAYED_FRAMES_BURST + RELAYED_FRAMES_PER_S * elapsed + 1, (flooded, sent[0], elapsed)
