"""What a rank does about its hardware: CPU threads shared among a node's ranks, the token budget it trained with
beside the memory it used, the autocast its evaluation runs under, and a clean distributed teardown.

:func:`share_cpu_threads` splits a CPU node's threads among its ranks: left at torch's default, every rank
runs one thread per core, and N ranks' spinning OpenMP threads fight over the cores (the first step of 2 ranks on
2 cores took 4.4 s instead of 1.1 s in about half the launches). The defaults chosen from the hardware before a
run starts are :mod:`textsql.planning.device_defaults`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)


def share_cpu_threads(local_ranks: int) -> int | None:
    """On a CPU, give each of this node's ``local_ranks`` ranks an equal share of torch's threads; the share, or
    ``None`` on a GPU or where ``OMP_NUM_THREADS`` already says how many (as DeepSpeed's ``--bind_cores_to_rank``
    and torchrun do).

    :rtype: int | None
    """
    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, torch.get_num_threads() // max(1, local_ranks))
    torch.set_num_threads(threads)
    logger.info("%d torch thread(s) for each of %d rank(s) on this node", threads, local_ranks)
    return threads


def token_budget_record(max_tokens_per_batch: int | None) -> dict[str, Any]:
    """The token budget a run trained with beside the GPU memory it had and the most torch allocated (GiB; ``None``
    on CPUs): what run.json keeps so :data:`textsql.planning.device_defaults.TOKENS_PER_GIB`, a first guess, can be checked on the GPUs that ran.

    :rtype: dict[str, typing.Any]
    """
    cuda = torch.cuda.is_available()
    return {
        "max_tokens_per_batch": max_tokens_per_batch,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 1024**3, 1) if cuda else None,
        "cuda_max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 1024**3, 3) if cuda else None,
    }


def teardown_distributed() -> None:
    """Wait for every rank, then destroy the process group (NCCL warns at exit when it was never destroyed).

    On NCCL the barrier names this rank's GPU, so NCCL does not guess the device.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from accelerate.state import AcceleratorState

    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
    else:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # accelerate's shared state would still point at the destroyed group; cleared, a later run in the
    # same process (a notebook kernel) builds a new one.
    AcceleratorState._reset_state(reset_partial_state=True)
    logger.info("process group destroyed")


def engine_autocast(engine: object) -> contextlib.AbstractContextManager:
    """The torch autocast a DeepSpeed engine runs its forward under (its ``torch_autocast`` section); nothing for
    an engine without it, or a model that is no engine.

    :rtype: contextlib.AbstractContextManager
    """
    if not callable(getattr(engine, "torch_autocast_enabled", None)):
        return contextlib.nullcontext()
    from deepspeed.runtime.torch_autocast import autocast_if_enabled

    return autocast_if_enabled(engine)
