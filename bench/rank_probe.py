"""Run ``textsql.training.train`` on one rank and record that rank's peak resident memory when it exits.

Launched by the profiles benchmark as the ranks' module (``textsql launch ... --module bench.rank_probe``).
The kernel's own high-water mark (``ru_maxrss``) is read at exit, so no peak is missed between samples.
The file goes to ``$TEXTSQL_BENCH_PROBE_DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import atexit
import logging
import os
import resource
import sys
from pathlib import Path

import torch

from textsql.files import write_json
from textsql.training import train

logger = logging.getLogger(__name__)

PROBE_DIR_VAR = "TEXTSQL_BENCH_PROBE_DIR"


def record_peak_memory() -> None:
    """Write this process's peak resident set size (bytes) for its rank."""
    rank = os.environ.get("RANK", "0")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    path = Path(os.environ[PROBE_DIR_VAR]) / f"rank{rank}.json"
    # On a GPU, also the device's high-water mark of tensors allocated by torch.
    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    write_json(path, {"rank": int(rank), "peak_rss_bytes": peak, "cuda_max_memory_allocated_bytes": cuda_peak})


if __name__ == "__main__":
    atexit.register(record_peak_memory)
    sys.exit(train.main())
