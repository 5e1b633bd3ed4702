"""A rank's heartbeat on its own pod's channel: rank to its agent over a local socket, agent to the master signed.

pdsh merges every host's output into one stream, and a host controls all its text after its ``host: `` prefix:
a NUL in a line makes pdsh drop that line's newline (it prints with ``%s``), so the next host's line is glued
onto the hostile one's. Liveness read from that stream alone is therefore only as good as the worst host's
output. Here each rank also sends its heartbeat, ``RANK STEP PROGRESS`` in one datagram, to its own agent:

- the agent binds a Unix datagram socket in a fresh 0700 directory on the pod's own disk (:class:`BeatInbox`,
  never the shared run directory) and names it to its ssh sessions, so to the ranks, in :data:`~worker.constants.ENV_BEAT_SOCKET`;
- a rank sends with :func:`send_beat`: one non-blocking datagram, never an error (a heartbeat must not stop a
  rank);
- the agent relays the newest beat of each rank to the master on its held rendezvous connection, each frame
  signed with its pod's key over both nonces and a sequence number (:mod:`worker.rendezvous.client`);
- the master checks the frame (:func:`beats_from_wire`) and credits the beats to the address that pod registered,
  for the ranks that address runs only (:mod:`textsql.launching.stall`).

Another pod can neither send for this pod (it lacks the key) nor swallow its beats (they never cross pdsh).

Usage::

    >>> decode_beat(encode_beat(Beat(rank=1, step=4, progress=9)))
    Beat(rank=1, step=4, progress=9)
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import NamedTuple, Self

from worker.constants import MAX_BEAT_BYTES, MAX_SLOTS
from worker.errors import RendezvousError, WorkerError

# One datagram: three decimal counts. A count past this is no count of a real run's steps.
_DATAGRAM = re.compile(rb"(\d{1,15}) (\d{1,15}) (\d{1,15})")
_LARGEST = 10**15 - 1
# Datagrams one drain reads at most: a flood from the pod's own processes cannot keep the agent from its connection.
_DRAIN_AT_MOST = 16 * MAX_SLOTS


class InvalidBeats(RendezvousError):
    """A relayed frame's beats are not a short list of ``[rank, step, progress]`` counts."""


class Beat(NamedTuple):
    """What a rank says about itself: its global rank, its optimizer step, and its count of finished work."""

    rank: int
    step: int
    progress: int


def encode_beat(beat: Beat) -> bytes:
    """The datagram a rank sends for ``beat``.

    :param beat: the rank's heartbeat.
    :rtype: bytes
    """
    return f"{beat.rank} {beat.step} {beat.progress}".encode("ascii")


def decode_beat(datagram: bytes) -> Beat | None:
    """The beat in a datagram, or None when it is not exactly one.

    :param datagram: what arrived on the agent's socket.
    :rtype: Beat | None
    """
    found = _DATAGRAM.fullmatch(datagram)
    return Beat(*(int(count) for count in found.groups())) if found else None


def send_beat(path: str, beat: Beat) -> bool:
    """Send ``beat`` to the agent listening at ``path``; never blocks, never raises.

    :param path: the agent's socket (:data:`~worker.constants.ENV_BEAT_SOCKET`).
    :param beat: the rank's heartbeat.
    :rtype: bool
    :returns: whether the datagram was sent (False: no agent there, or its queue is full).
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.setblocking(False)
            sender.sendto(encode_beat(beat), path)
    except OSError:
        return False
    return True


def beats_from_wire(value: object) -> list[Beat]:
    """The beats of a relayed frame, checked: a list of at most :data:`MAX_SLOTS` ``[rank, step, progress]``
    lists of non-negative integers.

    :param value: the frame's ``beats`` field, not yet checked.
    :rtype: list[Beat]
    :raises InvalidBeats: naming what is wrong.
    """
    if not isinstance(value, list) or len(value) > MAX_SLOTS:
        raise InvalidBeats(f"beats must be a list of at most {MAX_SLOTS} heartbeats")
    beats = []
    for item in value:
        if not isinstance(item, list) or len(item) != 3 or not all(_is_count(count) for count in item):
            raise InvalidBeats("a heartbeat must be [rank, step, progress], each an integer from 0")
        beats.append(Beat(*item))
    return beats


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _LARGEST


class BeatInbox:
    """The agent's end: a Unix datagram socket in a fresh 0700 directory of the pod's own temporary space, which
    only this pod's processes reach. :meth:`drain` gives the newest beat of each rank heard since the last."""

    def __init__(self) -> None:
        """
        :raises WorkerError: when the socket cannot be opened (the message names the fix).
        """
        self.directory = Path(tempfile.mkdtemp(prefix="textsql-beats-"))
        self.path = str(self.directory / "beats.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._socket.bind(self.path)
        except OSError as error:  # a path past the 107 bytes a Unix socket's name may have, a full disk
            self.close()
            raise WorkerError(
                f"cannot open the ranks' heartbeat socket {self.path}: {error}; set TMPDIR to a short local directory"
            ) from None
        self._socket.setblocking(False)

    def fileno(self) -> int:
        """The socket's descriptor, for a selector.

        :rtype: int
        """
        return self._socket.fileno()

    def drain(self) -> list[Beat]:
        """The newest beat of each rank among the datagrams waiting (at most a bounded number of them), at most
        :data:`MAX_SLOTS` ranks; what is not a beat is dropped.

        :rtype: list[Beat]
        """
        newest: dict[int, Beat] = {}
        for _ in range(_DRAIN_AT_MOST):
            try:
                datagram = self._socket.recv(MAX_BEAT_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                break
            beat = decode_beat(datagram)
            if beat is not None and (beat.rank in newest or len(newest) < MAX_SLOTS):
                newest[beat.rank] = beat
        return list(newest.values())

    def close(self) -> None:
        """Close the socket and remove its directory. Safe to call twice."""
        self._socket.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
