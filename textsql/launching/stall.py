"""Tell a stalled run from a slow one: no rank has advanced for the stall timeout.

Every training rank prints a heartbeat line every :data:`~textsql.rank_lines.HEARTBEAT_INTERVAL_S` seconds from a
thread of its own (:class:`textsql.training.progress.Heartbeat`, the line in :mod:`textsql.rank_lines`): its rank,
its optimizer step and a count of everything it has finished (steps, evaluation batches, saves), so an
evaluation or a save reads as progress too. :class:`StallDetector` hears them on one of two channels:

- **A worker pod's agent** (``start_workers``' launched workers, :attr:`StallDetector.relayed`): each rank also
  sends its heartbeat to its own pod's agent, which relays it on its rendezvous connection signed with the pod's
  key (:mod:`worker.beats`); :meth:`StallDetector.beat` takes it for the address that pod registered. Such a
  host's heartbeat lines on the launch's stream are ignored: no other host can glue them away or speak for them.
- **The launch's stream**, for hosts with no agent (a hostfile's static hosts reached over ssh): pdsh prefixes
  each line with ``host: ``; :meth:`StallDetector.read` takes the heartbeat lines. There a host can glue another's
  lines onto its own with a NUL (:mod:`textsql.rank_lines`): those are nobody's word, so a hostile static host can
  make an honest one look silent, though never speak for it.

- **Whose word**: a heartbeat counts only for a rank its host runs (the hostfile's order and slots, as
  DeepSpeed numbers the ranks), a count only moves forward, and ``step N/M`` lines only from rank 0's host:
  a worker cannot speak for another host's ranks.
- **Progress**: any rank's count or step went up. The gaps between progress are the run's step times; the
  time to the first progress (start-up, DeepSpeed's op compilation, the first step) is never one of them.
  (Not the slowest rank's count: a rank stopped a moment after a few fast steps may never have said so.)
- **Stalled**: progress has been seen, and then either none for the stall timeout (the one given, or by
  default :data:`STALL_FACTOR` times the slowest gap seen, at least :data:`MIN_STALL_TIMEOUT_S`), or a host
  of the launch silent for that long while others report progress: a worker's word keeps only its own host
  alive, so one that reports progress it has not made cannot hide another host's frozen ranks. Before a gap
  has been seen the default timeout has nothing to scale, so only a given timeout applies; the process-group
  timeout bounds that stretch.
- **Which host**: a rank stopped by SIGSTOP, or frozen with its whole process, stops its heartbeat too,
  while ranks merely waiting for it in a collective go on beating (the wait releases the GIL). The stalled
  hosts are those whose heartbeat has been silent for half the stall timeout, or never heard, among the
  launch's hosts; when every host still beats (a collective that never returns), all of them.

Usage::

    >>> detector = StallDetector(timeout=60, hosts={"127.0.0.2": 1, "127.0.0.3": 1})
    >>> detector.read("127.0.0.3: heartbeat rank 1 step 4 progress 9")
    >>> detector.stalled()
    False
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from textsql.rank_lines import HEARTBEAT_INTERVAL_S, HEARTBEAT_LINE, rank0_step, ranks_by_host, split_host_prefix
from worker.beats import Beat

# The default stall timeout: this many times the slowest gap between progress, and never below the minimum.
STALL_FACTOR = 4.0
MIN_STALL_TIMEOUT_S = 120.0
# A given stall timeout must leave room for a few heartbeats, or every host would read as silent.
SHORTEST_STALL_TIMEOUT_S = 4 * HEARTBEAT_INTERVAL_S


@dataclass
class StallDetector:
    """Reads a launch's lines and says when it has stalled, and on which hosts (see the module docstring).

    :param timeout: seconds without progress that make a stall (None: the default, from the step times).
    :param clock: seconds, monotonic; injected by tests.
    :param hosts: the launch's hostfile, host to slots in its order (pdsh's line prefixes; empty for the local
        launcher).
    :param relayed: the hosts whose agents relay their ranks' heartbeats (:meth:`beat`); their heartbeat lines
        are ignored.
    """

    timeout: float | None = None
    clock: Callable[[], float] = time.monotonic
    hosts: dict[str, int] = field(default_factory=dict)
    relayed: frozenset[str] = frozenset()
    # Per (host, rank): the last count of finished work, and when its heartbeat was last read.
    counts: dict[tuple[str | None, int], int] = field(default_factory=dict)
    beats: dict[tuple[str | None, int], float] = field(default_factory=dict)
    last_progress_at: float | None = None
    slowest_gap: float | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        self.ranks = ranks_by_host(self.hosts)
        # When progress was first seen: a host never heard from is silent since then.
        self.first_progress_at: float | None = None
        # Agents' heartbeats arrive on the rendezvous' threads, lines on the launch's.
        self._lock = threading.Lock()

    def read(self, line: str) -> None:
        """Take one line of the launch's stream (other lines, what a host says for another's ranks, and the
        heartbeat lines of a host whose agent relays them, are ignored).

        :param line: the line without its newline.
        """
        host, text = split_host_prefix(line, self.hosts)
        if self.hosts and host is None:
            return
        heard = HEARTBEAT_LINE.match(text)
        if heard:
            if host not in self.relayed:
                self.beat(host, Beat(int(heard["rank"]), int(heard["step"]), int(heard["progress"])))
            return
        stepped = rank0_step(line, self.hosts)
        if stepped:
            with self._lock:
                if self.step is None or int(stepped["step"]) > self.step:
                    self._advanced(int(stepped["step"]))

    def beat(self, host: str | None, beat: Beat) -> None:
        """Take one rank's heartbeat from ``host`` (ignored for a rank it does not run).

        :param host: the host it comes from: its pdsh prefix, or the address its agent registered (None: the local
            launcher's one machine).
        :param beat: the rank's heartbeat.
        """
        if host is not None and beat.rank not in self.ranks.get(host, ()):
            return
        with self._lock:
            self.beats[host, beat.rank] = self.clock()
            if beat.progress > self.counts.get((host, beat.rank), 0):
                self.counts[host, beat.rank] = beat.progress
                self._advanced(beat.step)

    def limit(self) -> float | None:
        """Seconds without progress that make a stall now; None while there is nothing to scale the default by.

        :rtype: float | None
        """
        if self.timeout is not None:
            return self.timeout
        if self.slowest_gap is None:
            return None
        return max(MIN_STALL_TIMEOUT_S, STALL_FACTOR * self.slowest_gap)

    def idle(self) -> float:
        """Seconds since the last progress (0 before the first).

        :rtype: float
        """
        return 0.0 if self.last_progress_at is None else self.clock() - self.last_progress_at

    def stalled(self) -> bool:
        """Whether, once the run has made progress, no rank has advanced for the stall timeout or a host has been
        silent for it.

        :rtype: bool
        """
        limit = self.limit()
        if self.last_progress_at is None or limit is None:
            return False
        return self.idle() > limit or bool(self.silent_hosts(limit))

    def silent_hosts(self, quiet: float) -> list[str]:
        """The launch's hosts whose heartbeat has not been heard for ``quiet`` seconds (one never heard: since the
        first progress); none before the first progress.

        :rtype: list[str]
        """
        if self.first_progress_at is None:
            return []
        heard: dict[str, float] = {}
        # A copy: the launch's stop thread asks while the stream's thread reads lines.
        for (host, _), at in dict(self.beats).items():
            if host is not None:
                heard[host] = max(heard.get(host, at), at)
        now = self.clock()
        return [host for host in self.hosts if now - heard.get(host, self.first_progress_at) > quiet]

    def summary(self) -> str:
        """What made the stall, for a person (see :meth:`stalled`).

        :rtype: str
        """
        limit = self.limit() or MIN_STALL_TIMEOUT_S
        silent = self.silent_hosts(limit)
        if self.idle() > limit or not silent:
            return f"no rank advanced for {self.idle():.0f} s (stall timeout {limit:.0f} s)"
        return f"no heartbeat from {', '.join(silent)} for over {limit:.0f} s (the stall timeout)"

    def stalled_hosts(self) -> list[str | None]:
        """The hosts whose heartbeat has been silent for half the stall timeout; all of them when every one
        still beats (None: the local launcher's one machine).

        :rtype: list[str | None]
        """
        now, quiet = self.clock(), (self.limit() or MIN_STALL_TIMEOUT_S) / 2
        # A copy: the launch's stop thread asks while the stream's thread reads lines.
        beats = dict(self.beats)
        heard = {host for host, _ in beats}
        hosts = sorted(heard | set(self.hosts), key=str)
        silent = {host for (host, _), at in beats.items() if now - at > quiet} | (set(self.hosts) - heard)
        return sorted(silent, key=str) or hosts

    def _advanced(self, step: int) -> None:
        now = self.clock()
        if self.last_progress_at is not None:
            self.slowest_gap = max(self.slowest_gap or 0.0, now - self.last_progress_at)
        else:
            self.first_progress_at = now
        self.last_progress_at = now
        self.step = max(self.step or 0, step)
