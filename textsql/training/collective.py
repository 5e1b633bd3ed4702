"""The collective check every rank runs before the first training step: a run whose ranks cannot all-reduce
stops here in seconds, naming the host, instead of hanging in the first step for the process-group timeout.

All ranks all-reduce a tensor of known values (rank r contributes r + 1, so the sum is fixed) at a few sizes,
each within :data:`TIMEOUT_S`; the sizes also give the bus bandwidth (NCCL's convention: 2(n-1)/n times the
bytes over the time). Each rank writes its host into the process group's store, and a mark before it joins
each all-reduce, so a rank that timed out can tell which hosts never joined (or that all did, and the network
between them failed): the store is a TCP connection to rank 0's host, apart from the collective. Rank 0 writes the figures to
``OUTPUT_DIR/collective.json``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from textsql.constants import COLLECTIVE_FILE_NAME
from textsql.files import write_json

logger = logging.getLogger(__name__)

# Elements (float32) of each all-reduce: latency-bound, then two sizes where bandwidth shows.
SIZES = (1024, 256 * 1024, 2 * 1024 * 1024)
# Seconds each all-reduce may take; a healthy CPU pair needs well under one for the largest size.
TIMEOUT_S = 60.0
TIMEOUT_VAR = "TEXTSQL_COLLECTIVE_TIMEOUT_S"
# For tests: "HOST=SECONDS", the ranks on HOST wait that long before joining (a host whose all-reduce cannot
# complete); every rank gets the same variables, so the value names the host.
HOLD_VAR = "TEXTSQL_COLLECTIVE_HOLD"
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
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    expected = world * (world + 1) / 2
    sizes = []
    for index, size in enumerate(SIZES):
        tensor = torch.full((size,), float(rank + 1), dtype=torch.float32, device=device)
        store.set(f"textsql/collective/joined/{index}/{rank}", "1")
        started = time.perf_counter()
        work = dist.all_reduce(tensor, async_op=True)
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
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        got = tensor[0].item()
        if got != expected or not torch.all(tensor == expected):
            raise CollectiveError(
                f"all-reduce on {rank_host()} summed {got:g}, expected {expected:g}: the ranks' network or "
                "accelerator corrupts collectives; run the host's NCCL/gloo tests"
            )
        moved = size * 4
        sizes.append(
            {
                "bytes": moved,
                "seconds": round(seconds, 6),
                "bus_gbps": float(f"{2 * (world - 1) / world * moved / seconds / 1e9:.3g}"),
            }
        )
    hosts = [store.get(f"textsql/collective/host/{r}").decode() for r in range(world)]
    # Rank 0's host serves the store: it stays until every rank has read it.
    dist.barrier()
    result = {"world_size": world, "backend": dist.get_backend(), "hosts": hosts, "sizes": sizes}
    if rank == 0:
        write_json(Path(output_dir) / COLLECTIVE_FILE_NAME, result)
    logger.info("collective check: %s", ", ".join(f"{s['bytes']} B {s['bus_gbps']} GB/s" for s in sizes))
    return result


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
