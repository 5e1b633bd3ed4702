"""Run ``textsql.training.train`` on one rank and record that rank's peak memory and step times when it exits.

Launched by the profiles and GPU benchmarks as the ranks' module (``textsql launch ... --module
bench.rank_probe``). The kernel's own high-water mark (``ru_maxrss``) is read at exit, so no peak is missed
between samples; the trainer gets a :class:`bench.steps.StepClock` (every step's wall times, the
evaluations, and with ``$TEXTSQL_BENCH_PROFILE_STEP`` the op counts of that step; with
``$TEXTSQL_BENCH_STOP_BELOW`` training stops at the first evaluation at or below that loss, with
``$TEXTSQL_BENCH_STOP_AT`` (``METRIC>=VALUE``) at the first whose score reaches it, with
``$TEXTSQL_BENCH_TIME_CAP_S`` at the first step ending that long after the first began); with
``$TEXTSQL_BENCH_TIMELINE`` (``FIRST,STEPS``) a :class:`bench.timeline.Timeline` of those steps joins it. The file
goes to ``$TEXTSQL_BENCH_PROBE_DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import atexit
import logging
import os
import resource
import sys
from pathlib import Path

import torch

from bench.steps import StepClock, phase_markers
from bench.timeline import Timeline
from textsql.json_files import write_json
from textsql.training import train

logger = logging.getLogger(__name__)

PROBE_DIR_VAR = "TEXTSQL_BENCH_PROBE_DIR"
PROFILE_STEP_VAR = "TEXTSQL_BENCH_PROFILE_STEP"
STOP_BELOW_VAR = "TEXTSQL_BENCH_STOP_BELOW"  # an eval loss that ends training when reached
STOP_AT_VAR = "TEXTSQL_BENCH_STOP_AT"  # "METRIC>=VALUE": an evaluation score that ends training when reached
TIME_CAP_VAR = "TEXTSQL_BENCH_TIME_CAP_S"  # seconds of training after which it stops
TIMELINE_VAR = "TEXTSQL_BENCH_TIMELINE"  # "FIRST,STEPS": the steps bench.timeline profiles


def stop_at(text: str) -> tuple[str, float]:
    """``eval_lf_accuracy>=0.7`` as ``("eval_lf_accuracy", 0.7)``.

    :rtype: tuple[str, float]
    """
    metric, _, value = text.partition(">=")
    return metric.strip(), float(value)


CLOCK = StepClock(
    profile_step=int(os.environ.get(PROFILE_STEP_VAR, "0")),
    stop_below=float(os.environ[STOP_BELOW_VAR]) if os.environ.get(STOP_BELOW_VAR) else None,
    stop_at=stop_at(os.environ[STOP_AT_VAR]) if os.environ.get(STOP_AT_VAR) else None,
    time_cap_s=float(os.environ[TIME_CAP_VAR]) if os.environ.get(TIME_CAP_VAR) else None,
)
TIMELINE = Timeline(*map(int, os.environ[TIMELINE_VAR].split(","))) if os.environ.get(TIMELINE_VAR) else None


def record_peak_memory() -> None:
    """Write this process's peak resident set size (bytes) and its step clock for its rank."""
    rank = os.environ.get("RANK", "0")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    path = Path(os.environ[PROBE_DIR_VAR]) / f"rank{rank}.json"
    # On a GPU, also the device's high-water mark of tensors allocated by torch.
    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    write_json(
        path,
        {
            "rank": int(rank),
            "peak_rss_bytes": peak,
            "cuda_max_memory_allocated_bytes": cuda_peak,
            **CLOCK.record(),
            "timeline": TIMELINE.summary if TIMELINE else None,
        },
    )


def _with_clock(use_run_events):
    # train.main builds its trainer inside; the clock joins where the run's own callbacks do.
    def use(trainer) -> None:
        use_run_events(trainer)
        trainer.add_callback(CLOCK)
        if TIMELINE is not None:
            trainer.add_callback(TIMELINE)

    return use


if __name__ == "__main__":
    atexit.register(record_peak_memory)
    train.use_run_events = _with_clock(train.use_run_events)
    with phase_markers():
        sys.exit(train.main())
