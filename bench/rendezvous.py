"""``rendezvous_{64,256}_workers_s``: seconds from the first connection to the hostfile written.

The master side is the real :class:`worker.rendezvous.server.RendezvousServer` writing the real run files.
The workers are register-only (no sshd, as ``LocalBackend(sshd=False)`` runs agents for benchmarks)
and call :func:`worker.rendezvous.client.register`, the agent's own registration, over loopback TCP. They
are started beforehand (a few client processes, one thread per worker, every module imported) and
released at once, so the figure is the rendezvous and not how fast this 2-core machine forks 256
Pythons. Each worker holds its connection open until the run is complete, as an agent does.

A second figure, ``rendezvous_64_agents_end_to_end_s``, runs the real agents
(``start_workers("local", 64, sshd=False)``): from the call to the hostfile, process start included.
"""

from __future__ import annotations

import logging
import multiprocessing
import secrets
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.timing import summary
from worker.cluster import start_workers
from worker.constants import MAX_CONNECTIONS
from worker.registration import Registration
from worker.rendezvous.client import register
from worker.rendezvous.server import RendezvousServer
from worker.runfiles import RunFiles

logger = logging.getLogger(__name__)

CLIENT_PROCESSES = 4
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Sizes:
    """How many workers and repetitions."""

    counts: tuple[int, ...] = (64, 256)
    repetitions: int = 5
    warmup: int = 1
    agents: int | None = 64  # end-to-end run with real agent processes; None skips it


def worker_address(index: int) -> str:
    """A distinct loopback address per worker (127.1.x.y; register-only workers listen on nothing).

    :rtype: str
    """
    return f"127.1.{index // 250}.{index % 250 + 1}"


def _client(indices: list[int], endpoint: tuple[str, int], token: str, go, done, starts) -> None:
    """One client process: a thread per worker, all waiting for ``go``, each holding its session until ``done``."""
    registrations = [
        Registration(address=worker_address(i), slots=1, hostname=f"bench-{i}", pod=f"bench-{i}") for i in indices
    ]
    sessions, first = [], []

    def one(registration: Registration) -> None:
        go.wait()
        first.append(time.time())
        sessions.append(register(endpoint, token, registration))

    threads = [threading.Thread(target=one, args=(registration,)) for registration in registrations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    starts.put(min(first))
    done.wait()
    for session in sessions:
        session.close()


def once(count: int, backlog: int | None = None) -> float:
    """One rendezvous of ``count`` concurrent register-only workers; seconds to the hostfile.

    :param backlog: a listen backlog to try instead of the server's own ``request_queue_size``.
    :rtype: float
    """
    context = multiprocessing.get_context("fork")
    token = secrets.token_urlsafe(32)
    go, done, starts = context.Event(), context.Event(), context.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-rendezvous-") as run_dir:
        files = RunFiles.in_dir(Path(run_dir))
        server_class = (
            RendezvousServer
            if backlog is None
            else type("BacklogServer", (RendezvousServer,), {"request_queue_size": backlog})
        )
        with server_class(expect=count, token=token, files=files) as server:
            shares = [list(range(count))[i::CLIENT_PROCESSES] for i in range(CLIENT_PROCESSES)]
            clients = [
                context.Process(target=_client, args=(share, server.endpoint, token, go, done, starts))
                for share in shares
                if share
            ]
            for client in clients:
                client.start()
            time.sleep(0.5 + count / 200)  # let every client thread reach go.wait()
            go.set()
            try:
                server.wait(TIMEOUT_S)
                written = files.hostfile.stat().st_mtime
                first = min(starts.get(timeout=TIMEOUT_S) for _ in clients)
                lines = files.hostfile.read_text().splitlines()
            finally:
                done.set()
                for client in clients:
                    client.join(timeout=TIMEOUT_S)
                    if client.exitcode is None:
                        client.kill()
    if len(lines) != count:
        raise RuntimeError(f"hostfile has {len(lines)} lines, expected {count}")
    return written - first


def agents_end_to_end(count: int) -> float:
    """Real register-only agent processes through ``start_workers``; seconds from the call to the hostfile.

    :rtype: float
    """
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as run_dir:
        started = time.time()
        with start_workers("local", count, Path(run_dir), timeout=600, sshd=False) as cluster:
            return cluster.hostfile.stat().st_mtime - started


def run(sizes: Sizes = Sizes()) -> dict[str, dict]:
    """Every rendezvous figure, keyed as in results.json.

    :rtype: dict[str, dict]
    """
    figures = {}
    for _ in range(sizes.warmup):
        once(min(sizes.counts))
    for count in sizes.counts:
        seconds = [once(count) for _ in range(sizes.repetitions)]
        logger.info("rendezvous %d workers: median %.3f s", count, statistics.median(seconds))
        figure = figures[f"rendezvous_{count}_workers_s"] = {
            "value": round(statistics.median(seconds), 3),
            "unit": "s",
            "goal": "<= 2.0" if count == 64 else None,
            "seconds": summary(seconds, 3),
            "method": (
                f"{count} register-only workers in {CLIENT_PROCESSES} pre-started client processes (a thread each, "
                "worker.rendezvous.client.register over loopback TCP, HMAC-authenticated) released together; from the earliest "
                "client connect to the hostfile's mtime (written with known_hosts and ssh_config by RendezvousServer); "
                f"{sizes.warmup} warm-up rendezvous, {sizes.repetitions} repetitions, median"
            ),
        }
        if count > RendezvousServer.request_queue_size:
            # More simultaneous connects than the listen backlog: the overflow's SYNs are dropped and
            # retried by TCP after a second. What a backlog as large as the connection limit gives:
            larger = [once(count, MAX_CONNECTIONS) for _ in range(sizes.repetitions)]
            figure["with_listen_backlog"] = {
                "backlog": MAX_CONNECTIONS,
                "server_default": RendezvousServer.request_queue_size,
                "seconds": summary(larger, 3),
            }
    if sizes.agents:
        seconds = agents_end_to_end(sizes.agents)
        figures[f"rendezvous_{sizes.agents}_agents_end_to_end_s"] = {
            "value": round(seconds, 3),
            "unit": "s",
            "goal": None,
            "method": (
                f"worker.cluster.start_workers('local', {sizes.agents}, sshd=False): {sizes.agents} real `python -m worker.agent` "
                "processes started on this machine, each registering; from the call to the hostfile's mtime, so it includes "
                "starting every Python process on the shared 2 cores; one run"
            ),
        }
    return figures
