"""Releasing the shared-memory buffer of DeepSpeed's CPU all-reduce, so a run leaves no memory behind.

When every rank of a CPU run is on one machine, DeepSpeed's CPU communication op gives each rank a buffer of
about 70 MB in ``/dev/shm`` (``deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>``), maps
the other ranks' buffers, and never removes the names: each run, finished or killed, kept its buffers in
memory until the machine restarted (160 runs of two ranks held 19 GiB of a 23 GiB machine). Once every rank has mapped
every buffer (a barrier after the process group starts) the names are no longer needed: each rank removes its
own, and the kernel frees the memory when the last rank that maps it exits, however it exits.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

SHARED_MEMORY_DIR = Path("/dev/shm")
BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def buffer_name(rank: int) -> str:
    """The name DeepSpeed's CPU op gives ``rank``'s buffer in this run (its master address and port).

    :rtype: str
    """
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{BUFFER_PREFIX}_{os.getuid()}_{address}_{port}_{rank}"


def release_allreduce_buffer() -> None:
    """Remove this rank's buffer name once all ranks have mapped theirs.

    Every rank calls this right after the process group starts. The op gives either every rank a buffer (all
    on one machine, no GPU) or none, so either all ranks hold the barrier or none does (a GPU run is untouched).
    """
    if not dist.is_initialized():
        return
    buffer = SHARED_MEMORY_DIR / buffer_name(dist.get_rank())
    if buffer.exists():
        dist.barrier()
        buffer.unlink(missing_ok=True)
