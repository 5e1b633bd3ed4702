"""Refuse a cluster that cannot train before pdsh starts, from what each worker reported over the rendezvous.

Each worker's :class:`worker.inventory.Inventory` is compared with the master's own and with the
others': versions that differ (Python, torch and its CUDA, DeepSpeed, transformers, this project), slots
that differ from a GPU host's GPU count, and a checkpoint volume with room for fewer than two checkpoints.
Every problem is one line naming the pod, its address and the fix; all of them are raised together, so
one look fixes the cluster. Workers that reported no inventory (attached ``static`` hosts) are not judged.
``RUN_DIR/cluster.json`` records every host's inventory, the network interface its ranks use, and the problems
found (``textsql preflight --run-dir`` and notebook 02 show it: :func:`textsql.display.views.format_cluster`).

Usage::

    >>> check_cluster(cluster.workers, cluster.run_dir, model="default")
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from textsql.constants import CLUSTER_FILE_NAME
from textsql.errors import LaunchError
from textsql.json_files import write_json
from textsql.planning.profiles import OPTIMIZER_BYTES
from worker.inventory import VERSION_FIELDS, Inventory, collect
from worker.registration import Registration

logger = logging.getLogger(__name__)

GIB = 1024**3
# A checkpoint holds the fp32 weights the trainer saves for the model, the engine's copy of the module
# weights (fp32 on CPUs, the widest case) and the fp32 master weights with Adam's two moments: the same
# total at every ZeRO stage, only split into more files as the stage shards the optimizer.
CHECKPOINT_BYTES_PER_PARAMETER = 4 + 4 + OPTIMIZER_BYTES
# save_total_limit keeps two: the newest and the one before, while the next one is written.
CHECKPOINTS_KEPT = 2


class ClusterError(LaunchError):
    """The registered workers cannot train together; the message has one line per problem."""


def checkpoint_size(model: str | Path | None) -> int:
    """Bytes of one checkpoint of ``model`` (:data:`CHECKPOINT_BYTES_PER_PARAMETER` per parameter).

    :param model: hub id, model directory, or None/``default`` for the embedded T5 (only its config is read).
    :rtype: int
    """
    from textsql.model import load_config
    from textsql.planning.estimate import count_parameters

    total, _ = count_parameters(load_config(model))
    return total * CHECKPOINT_BYTES_PER_PARAMETER


def cluster_problems(
    workers: Sequence[Registration], master: Inventory, checkpoint_bytes: int | None = None
) -> list[str]:
    """One line per reason these workers cannot train together, each naming the pod and the fix.

    :param workers: the registrations, in node-rank order.
    :param master: the master's own inventory (:func:`worker.inventory.collect`).
    :param checkpoint_bytes: the size of one checkpoint (None: disk is not checked).
    :rtype: list[str]
    """
    judged = [worker for worker in workers if worker.inventory is not None]
    if not judged:
        return []
    problems = []
    for name in VERSION_FIELDS:
        # The master's version where it has the package (it starts the run and reads its results), else the first
        # worker's. CUDA only across workers: a master without a GPU may run torch's CPU build of the same release.
        if getattr(master, name) and name != "cuda":
            reference, where = getattr(master, name), "the master"
        else:
            reference, where = getattr(judged[0].inventory, name), f"pod {judged[0].pod}"
        for worker in judged:
            version = getattr(worker.inventory, name)
            if _release(name, version) != _release(name, reference):
                problems.append(
                    f"pod {worker.pod} ({worker.address}) has {name} {version or 'missing'}, {where} has {reference}: "
                    f"install {_requirement(name, reference)} there (the same image or requirements.txt on every host)"
                )
    for worker in judged:
        assert worker.inventory is not None  # judged holds only workers that reported one
        count = worker.inventory.accelerators
        if count and worker.slots != count:
            problems.append(
                f"pod {worker.pod} ({worker.address}) registered {worker.slots} slot(s) but has {count} "
                f"{worker.inventory.accelerator_model or 'GPU'}(s): set worker_gpus to {count} (TEXTSQL_WORKER_GPUS), "
                "one rank per GPU"
            )
        free = worker.inventory.free_disk_bytes
        if checkpoint_bytes and free is not None and free < CHECKPOINTS_KEPT * checkpoint_bytes:
            problems.append(
                f"pod {worker.pod} ({worker.address}) has {free / GIB:.2f} GiB free where the ranks run, "
                f"{CHECKPOINTS_KEPT} checkpoints need {CHECKPOINTS_KEPT * checkpoint_bytes / GIB:.2f} GiB: "
                "free space there or put the run on a larger volume"
            )
    return problems


def check_cluster(
    workers: Sequence[Registration], run_dir: Path, model: str | None, socket_ifname: str | None = None
) -> None:
    """Record the cluster in ``RUN_DIR/cluster.json``, then refuse it when :func:`cluster_problems` finds any,
    before anything is launched on it.

    :param workers: the registrations, in node-rank order.
    :param run_dir: the run directory (the master's free disk is not judged: the workers' is where ranks write).
    :param model: the model trained (for the checkpoint's size).
    :param socket_ifname: the launch's ``--socket-ifname`` (None: each host uses the interface it reported).
    :raises ClusterError: one line per problem.
    """
    master = collect(None, run_dir)
    judged = any(worker.inventory is not None for worker in workers)
    problems = cluster_problems(workers, master, checkpoint_size(model)) if judged else []
    write_json(
        Path(run_dir) / CLUSTER_FILE_NAME, cluster_record(workers, master, socket_ifname) | {"problems": problems}
    )
    if not judged:
        logger.info("no worker reported an inventory (attached hosts); the cluster check is skipped")
        return
    if problems:
        raise ClusterError(
            f"this cluster cannot train ({len(problems)} problem(s)), nothing was launched:\n" + "\n".join(problems)
        )
    logger.info("cluster check passed for %d worker(s)", len(workers))


def cluster_record(workers: Sequence[Registration], master: Inventory, socket_ifname: str | None) -> dict:
    """What ``cluster.json`` holds: the master's inventory, and each host's with the interface its ranks use.

    :rtype: dict
    """
    hosts = []
    for worker in workers:
        reported = worker.inventory.interface if worker.inventory else None
        hosts.append(
            {
                "pod": worker.pod,
                "address": worker.address,
                "slots": worker.slots,
                "socket_ifname": socket_ifname or reported,
                "inventory": worker.inventory.to_dict() if worker.inventory else None,
            }
        )
    return {"master": master.to_dict(), "hosts": hosts}


def _release(name: str, version: str | None) -> str | None:
    # torch's local label names its build (2.13.0+cpu, 2.13.0+cu128); the build is judged by the cuda field.
    return version.split("+")[0] if name == "torch" and version else version


def _requirement(name: str, version: str | None) -> str:
    if name in ("python", "cuda"):
        return f"{'Python' if name == 'python' else 'a torch built for CUDA'} {version}"
    return f"{name}=={version}"
