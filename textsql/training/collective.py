"""The collective check every rank runs before the first training step: a run whose ranks cannot all-reduce
stops here in seconds, naming the host, instead of hanging in the first step for the process-group timeout.

All ranks all-reduce a tensor of known values (rank r contributes r + 1, so the sum is fixed) at a few sizes,
each within :data:`TIMEOUT_S`; the sizes also give the bus bandwidth (NCCL's convention: 2(n-1)/n times the
bytes over the time). Each rank writes its host into the process group's store, and a mark before it joins
each all-reduce, so a rank that timed out can tell which hosts never joined (or that all did, and the network
between them failed): the store is a TCP connection to rank 0's host, apart from the collective.

Each all-reduce starts together on every rank (a barrier), and each rank writes into the store how long after
that start it joined and how long its all-reduce then took: per host, its result and bandwidth, and how long the
others waited for it. In a ring all-reduce every rank finishes at once, so a slow host shows as the one the others
wait for; one they waited for more than :data:`SLOW_FACTOR` times the all-reduce's own time (and at least
:data:`SLOW_MIN_S`) on every size is slow, and the run stops here naming it: each training step would wait for
it the same way, and a single late all-reduce (a scheduling hiccup) does not count. Rank 0 writes the figures to
``OUTPUT_DIR/collective.json``; the training summary (``run.json``) holds them too.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from textsql.constants import COLLECTIVE_FILE_NAME
from textsql.json_files import write_json

logger = logging.getLogger(__name__)

# Elements (float32) of each all-reduce: latency-bound, then two sizes where bandwidth shows.
SIZES = (1024, 256 * 1024, 2 * 1024 * 1024)
# Seconds each all-reduce may take; a healthy CPU pair needs well under one for the largest size.
TIMEOUT_S = 60.0
TIMEOUT_VAR = "TEXTSQL_COLLECTIVE_TIMEOUT_S"
# For tests: "HOST=SECONDS", the ranks on HOST wait that long before joining (a host whose all-reduce cannot
# complete); every rank gets the same variables, so the value names the host.
HOLD_VAR = "TEXTSQL_COLLECTIVE_HOLD"
# For tests: "HOST=SECONDS", the ranks on HOST join each all-reduce that long after the others (a slow host).
SLOW_VAR = "TEXTSQL_COLLECTIVE_SLOW"
# A host the others waited for more than this many times the all-reduce's own time, on every size, is slow...
SLOW_FACTOR = 3.0
# ...and never for less than this: on a loaded CPU machine a rank can be descheduled for a few hundred ms.
SLOW_MIN_S = 1.0
_POLL_S = 0.01


class CollectiveError(RuntimeError):
    """The ranks could not all-reduce: a wrong sum or a host that never finished."""


def rank_host() -> str:
    """This rank's host as the launch knows it: the address pdsh's ssh session reached, else the hostname.

    :rtype: str
    """
    connection = os.environ.get("SSH_CONNECTION", "").split()
    return connection[2] if len(connection) == 4 else socket.gethostname()


def check_collective(output_dir: str | Path, timeout_s: float | None = None) -> dict:
    """All-reduce known tensors on every rank of the default process group; the figures, or CollectiveError.

    :param output_dir: where rank 0 writes ``collective.json``.
    :param timeout_s: seconds each all-reduce may take (default: ``$TEXTSQL_COLLECTIVE_TIMEOUT_S`` or :data:`TIMEOUT_S`).
    :rtype: dict
    :raises CollectiveError: naming the hosts that did not finish, or the wrong sum.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    timeout_s = float(os.environ.get(TIMEOUT_VAR, TIMEOUT_S)) if timeout_s is None else timeout_s
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"textsql/collective/host/{rank}", rank_host())
    held_host, _, hold_s = os.environ.get(HOLD_VAR, "").partition("=")
    if held_host == rank_host():
        time.sleep(float(hold_s))
    slow_host, _, slow_s = os.environ.get(SLOW_VAR, "").partition("=")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    expected = world * (world + 1) / 2
    for index, size in enumerate(SIZES):
        tensor = torch.full((size,), float(rank + 1), dtype=torch.float32, device=device)
        store.set(f"textsql/collective/joined/{index}/{rank}", "1")
        _wait(dist.barrier(async_op=True), store, world, index, timeout_s)
        started = time.perf_counter()
        if slow_host == rank_host():
            time.sleep(float(slow_s))
        joined = time.perf_counter()
        _wait(dist.all_reduce(tensor, async_op=True), store, world, index, timeout_s)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - joined
        got = tensor[0].item()
        if got != expected or not torch.all(tensor == expected):
            raise CollectiveError(
                f"all-reduce on {rank_host()} summed {got:g}, expected {expected:g}: the ranks' network or "
                "accelerator corrupts collectives; run the host's NCCL/gloo tests"
            )
        store.set(f"textsql/collective/time/{index}/{rank}", f"{joined - started:.6f} {seconds:.6f}")
    hosts = [store.get(f"textsql/collective/host/{r}").decode() for r in range(world)]
    timings = [
        [_timing(store.get(f"textsql/collective/time/{index}/{r}")) for r in range(world)]
        for index in range(len(SIZES))
    ]
    # Rank 0's host serves the store: it stays until every rank has read it.
    _wait(dist.barrier(async_op=True), store, world, len(SIZES) - 1, timeout_s)
    result = figures(hosts, timings, dist.get_backend())
    if rank == 0:
        write_json(Path(output_dir) / COLLECTIVE_FILE_NAME, result)
    if result["slow_hosts"]:
        raise CollectiveError(
            "; ".join(
                f"{slow['host']} is slow: the other hosts waited {slow['waited_s']:.2g} s for it on every all-reduce, "
                f"which itself took {slow['all_reduce_s']:.2g} s"
                for slow in result["slow_hosts"]
            )
            + ": check that host's load and network (per host figures in collective.json)"
        )
    logger.info("collective check: %s", ", ".join(f"{s['bytes']} B {s['bus_gbps']} GB/s" for s in result["sizes"]))
    return result


def figures(hosts: list[str], timings: list[list[tuple[float, float]]], backend: str) -> dict:
    """The check's record: bus bandwidth per size, each host's result and bandwidth, and the slow hosts.

    :param hosts: each rank's host, by rank.
    :param timings: per size, per rank: (seconds from the common start to joining, seconds joined to done).
    :param backend: the process group's backend.
    :rtype: dict
    """
    world = len(hosts)

    def size_figure(moved: int, seconds: float) -> dict:
        gbps = 2 * (world - 1) / world * moved / seconds / 1e9 if seconds > 0 else 0.0
        return {"bytes": moved, "seconds": round(seconds, 6), "bus_gbps": float(f"{gbps:.3g}")}

    # Each rank's all-reduce time once every rank had joined (what it spent waiting for later ones taken off), and
    # the all-reduce's own time: the fastest of those.
    effective = [
        [max(seconds - (max(lag for lag, _ in per_rank) - joined_after), 0.0) for joined_after, seconds in per_rank]
        for per_rank in timings
    ]
    own = [min(per_rank) for per_rank in effective]
    per_host = []
    slow_hosts = []
    for host in dict.fromkeys(hosts):
        ranks = [rank for rank, name in enumerate(hosts) if name == host]
        waited = [max(timings[index][rank][0] for rank in ranks) for index in range(len(SIZES))]
        slow = all(wait > max(SLOW_FACTOR * seconds, SLOW_MIN_S) for wait, seconds in zip(waited, own))
        per_host.append(
            {
                "host": host,
                "result": "slow" if slow else "ok",
                "waited_for_s": [round(seconds, 6) for seconds in waited],
                "sizes": [
                    size_figure(4 * size, max(effective[index][rank] for rank in ranks))
                    for index, size in enumerate(SIZES)
                ],
            }
        )
        if slow:
            slow_hosts.append(
                {"host": host, "waited_s": statistics.median(waited), "all_reduce_s": statistics.median(own)}
            )
    return {
        "world_size": world,
        "backend": backend,
        "hosts": hosts,
        "sizes": [size_figure(4 * size, seconds) for size, seconds in zip(SIZES, own)],
        "per_host": per_host,
        "slow_hosts": slow_hosts,
    }


def _wait(work: Any, store: Any, world: int, index: int, timeout_s: float) -> None:
    """Wait for a collective, at most ``timeout_s``; a timeout names the ranks that never joined size ``index``."""
    started = time.perf_counter()
    while not work.is_completed():
        if time.perf_counter() - started > timeout_s:
            absent = _not_joined(store, world, index)
            raise CollectiveError(
                f"all-reduce {index + 1} of {len(SIZES)} did not complete within {timeout_s:g} s; "
                + (
                    f"never joined: {', '.join(absent)}: check that host's ranks (launch.log)"
                    if absent
                    else "every rank joined: check the network between the hosts (their interfaces in cluster.json)"
                )
            )
        time.sleep(_POLL_S)
    work.wait()


def _timing(value: bytes) -> tuple[float, float]:
    """A rank's "JOINED_AFTER SECONDS" from the store."""
    joined_after, seconds = value.split()
    return float(joined_after), float(seconds)


def _not_joined(store: Any, world: int, index: int) -> list[str]:
    """The ranks, with their hosts, that never started all-reduce ``index`` (as the store shows)."""
    absent = []
    for rank in range(world):
        if not store.check([f"textsql/collective/joined/{index}/{rank}"]):
            host_key = f"textsql/collective/host/{rank}"
            absent.append(f"rank {rank} on {store.get(host_key).decode() if store.check([host_key]) else '?'}")
    return absent


def exit_on_failure(output_dir: str | Path) -> dict:
    """:func:`check_collective`, ending this rank with one line and exit code 1 when it fails.

    The collective that timed out holds gloo's or NCCL's threads, so an orderly shutdown could hang: the
    process ends at once instead, and the launcher ends the other ranks.

    :rtype: dict
    """
    try:
        return check_collective(output_dir)
    except CollectiveError as error:
        print(f"CollectiveError: {error}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)
