"""The rendezvous's registry: which workers a run has, and the rules for joining and leaving it.

Pure state under one lock, with no sockets and no files: the server (transport) asks it to
:meth:`Registry.record` a verified registration and acts on the answer, writing the run's files
outside the lock. The rules that keep a run's trust fixed once given:

- an accepted registration is immutable: while it stands, a second registration for the same pod or
  the same address is refused, whatever it carries, and only the connection it came on can end it;
- a pod given up for a replacement (:meth:`Registry.reopen`) never registers again;
- once the run is complete, nothing joins until a worker is given up.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from worker.registration import Registration, node_order

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    """The registration stands. ``complete`` holds every worker, in node-rank order, when it was the last one."""

    count: int
    complete: tuple[Registration, ...] | None = None


@dataclass(frozen=True)
class Refused:
    """The registration was refused; ``reason`` is the one line sent to the worker."""

    reason: str


class Registry:
    """The registrations of one run, keyed by address, each with the connection that holds it.

    :param expect: how many workers make the run complete.
    """

    def __init__(self, expect: int) -> None:
        self.expect = expect
        self._lock = threading.Lock()
        self._by_address: dict[str, tuple[Registration, object]] = {}
        # Pods given up for a replacement: their credentials must not bring them back.
        self._retired: set[str] = set()
        # Workers whose held connection dropped once the run was complete: address -> why.
        self._lost: dict[str, str] = {}
        self._complete = False

    @property
    def workers(self) -> list[Registration]:
        """Registrations so far, in node-rank order.

        :rtype: list[Registration]
        """
        with self._lock:
            return sorted((registration for registration, _ in self._by_address.values()), key=node_order)

    def record(self, registration: Registration, holder: object) -> Accepted | Refused:
        """Accept ``registration`` held by ``holder`` (its connection), or say why not.

        :param registration: a verified, validated registration.
        :param holder: the connection that speaks for this worker from now on.
        :rtype: Accepted | Refused
        """
        with self._lock:
            if registration.pod in self._retired:
                return Refused(f"pod {registration.pod!r} was replaced in this run; it cannot register again")
            same_pod = next((r for r, _ in self._by_address.values() if r.pod == registration.pod), None)
            if same_pod is not None:
                return Refused(
                    f"pod {registration.pod!r} is already registered from {same_pod.address}; an accepted "
                    "registration cannot be changed: stop the pod and start a new one"
                )
            existing = self._by_address.get(registration.address)
            if existing is not None:
                return Refused(
                    f"address {registration.address} is already registered by pod {existing[0].pod!r}; "
                    "each worker needs its own address"
                )
            if self._complete:
                return Refused(f"the run is full: {self.expect} of {self.expect} workers registered")
            self._by_address[registration.address] = (registration, holder)
            count = len(self._by_address)
            logger.info(
                "registered %s (pod %s, %d slots) %d/%d",
                registration.address,
                registration.pod,
                registration.slots,
                count,
                self.expect,
            )
            if count < self.expect:
                return Accepted(count)
            self._complete = True
            ordered = sorted((r for r, _ in self._by_address.values()), key=node_order)
            return Accepted(count, tuple(ordered))

    def forget(self, registration: Registration, holder: object, reason: str = "") -> None:
        """The connection holding ``registration`` ended: drop it before the run is complete, else count it lost.

        :param registration: what the worker registered.
        :param holder: the connection that ended (one that does not hold the registration changes nothing).
        :param reason: why the connection ended, for the log.
        """
        with self._lock:
            current = self._by_address.get(registration.address)
            if current is None or current[1] is not holder:
                return
            if self._complete:
                self._lost[registration.address] = (
                    f"pod {registration.pod} disconnected from the rendezvous: {reason or 'connection closed'}"
                )
                message = "worker %s (pod %s) disconnected during the run: %s"
            else:
                del self._by_address[registration.address]
                message = "worker %s (pod %s) left before the run was complete: %s"
        logger.warning(message, registration.address, registration.pod, reason)

    def holds(self, registration: Registration, holder: object) -> bool:
        """Whether ``registration`` stands, held by ``holder``.

        :param registration: what a worker registered.
        :param holder: its connection.
        :rtype: bool
        """
        with self._lock:
            current = self._by_address.get(registration.address)
        return current is not None and current[0] == registration and current[1] is holder

    def lost(self) -> dict[str, str]:
        """Workers whose connection ended after the run was complete: address -> why.

        :rtype: dict[str, str]
        """
        with self._lock:
            return dict(self._lost)

    def reopen(self, address: str) -> None:
        """Give up the worker at ``address`` for a replacement: its pod is retired and the run is
        incomplete until one more worker registers.

        :param address: the lost worker's address.
        """
        with self._lock:
            given_up = self._by_address.pop(address, None)
            if given_up is not None:
                self._retired.add(given_up[0].pod)
            self._lost.pop(address, None)
            self._complete = False

    def drop(self, address: str) -> None:
        """Go on without the worker at ``address``: its pod is retired and the run is complete again with
        the workers left, so a replacement that registers late is refused (the run is full).

        :param address: the lost worker's address.
        """
        with self._lock:
            given_up = self._by_address.pop(address, None)
            if given_up is not None:
                self._retired.add(given_up[0].pod)
            self._lost.pop(address, None)
            self.expect = len(self._by_address)
            self._complete = True
