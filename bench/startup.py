"""Start-up: seconds from running ``textsql launch`` to the end of the first training step.

The real command (``.venv/bin/textsql launch --launcher local --ranks 2 -- ...``) trains the embedded
small T5 with the demo's profile (zero1) on 2 local ranks; the first step's time is the wall time of
its loss event in the run's TensorBoard files. DeepSpeed's compiled ops are cached by then (the
profile runs before it have built and cached every op this needs), and one unmeasured launch warms
the file cache first.

The time is split into phases by when the launch's own output lines arrive: the master (the CLI and its
check of the training arguments, up to the launcher's ``cmd =`` line), the ranks' start (DeepSpeed's per-node
launcher, each rank's imports, parsing and process group, up to rank 0's ``stage: training`` line), and the
first step (the collective check, data and model, DeepSpeed's engine, step 1).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.events import step_wall_times
from bench.profiles import train_args, train_only
from bench.timing import summary
from textsql.constants import COLLECTIVE_FILE_NAME, DEFAULT_MODEL_DIR
from textsql.json_files import read_json
from textsql.rank_lines import STAGE_PREFIX
from textsql.training.events import TENSORBOARD_SUBDIR
from worker.network import free_port

logger = logging.getLogger(__name__)

PROFILE = "zero1"
RANKS = 2
# The output line that ends each phase but the last (see the module docstring).
PHASE_ENDS = {"master_s": "textsql.launching.launch: cmd = ", "ranks_start_s": f"{STAGE_PREFIX}training "}


@dataclass(frozen=True)
class Sizes:
    """Repetitions of the launch."""

    # Five, so the median is one run's time and a single slow launch does not move it.
    repetitions: int = 5
    warmup: int = 1


def local_launch(run_dir: Path, ranks: int, train_args: list[str], *options: str, verbose: bool = False) -> list[str]:
    """``textsql launch`` of ``train_args`` on ``ranks`` ranks of this machine, on a free master port, with the
    launch's own ``options`` before the ``--``.

    :rtype: list[str]
    """
    textsql = Path(sys.executable).parent / "textsql"
    return [
        str(textsql),
        *(["--verbose"] if verbose else []),
        "launch",
        *("--run-dir", str(run_dir), "--launcher", "local", "--ranks", str(ranks), "--master-port", str(free_port())),
        *options,
        "--",
        *train_args,
    ]


def once(data: Path, run_dir: Path) -> dict[str, float]:
    """One ``textsql launch``: seconds from the command to the first step's loss event, and per phase.

    :rtype: dict[str, float]
    """
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = local_launch(
        run_dir / "out", RANKS, train_args(DEFAULT_MODEL_DIR, data, run_dir / "out", PROFILE, steps=2, batch_size=8)
    )
    seen: dict[str, float] = {}
    with open(run_dir / "bench.log", "w", encoding="utf-8") as log:
        started = time.time()
        launch = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
        )
        assert launch.stdout is not None  # stdout=PIPE
        for line in launch.stdout:
            log.write(line)
            for phase, marker in PHASE_ENDS.items():
                if phase not in seen and marker in line:
                    seen[phase] = time.time()
        code = launch.wait()
    if code != 0:
        raise RuntimeError(f"textsql launch failed with exit code {code}; see {run_dir / 'bench.log'}")
    _first_step, first_time = step_wall_times(run_dir / "out" / TENSORBOARD_SUBDIR)[0]
    master, ranks = seen.get("master_s", started), seen.get("ranks_start_s", started)
    return {
        "total_s": first_time - started,
        "master_s": master - started,
        "ranks_start_s": ranks - master,
        "first_step_s": first_time - ranks,
    }


def run(data_dir: str, work: Path, sizes: Sizes = Sizes()) -> dict:
    """Launch ``warmup + repetitions`` times; the median of the measured ones.

    :rtype: dict
    """
    data = train_only(data_dir, work)
    for index in range(sizes.warmup):
        once(data, work / f"startup-warmup-{index}")
    runs = [once(data, work / f"startup-{index}") for index in range(sizes.repetitions)]
    seconds = [run["total_s"] for run in runs]
    logger.info("start-up: median %.1f s", statistics.median(seconds))
    # The collective check every launch runs before its first step (inside the time above): its all-reduces.
    collective = read_json(work / f"startup-{sizes.repetitions - 1}" / "out" / COLLECTIVE_FILE_NAME)
    return {
        "value": round(statistics.median(seconds), 1),
        "unit": "s",
        "goal": None,
        "seconds": summary(seconds, 1),
        # Medians of each phase (they need not add up to the median total).
        "phases_s": {
            phase: round(statistics.median(run[phase] for run in runs), 1) for phase in runs[0] if phase != "total_s"
        },
        "collective_check": {
            "backend": collective["backend"],
            "ranks": collective["world_size"],
            "sizes": collective["sizes"],
        },
        "method": (
            f"`textsql launch --launcher local --ranks {RANKS}` as a subprocess, embedded small T5, profile {PROFILE}, batch 8 per "
            "rank; from starting the command to the wall time of step 1's train/loss event (step 1 done); DeepSpeed ops "
            f"already cached; {sizes.warmup} warm-up launch, {sizes.repetitions} measured, median; the ranks' collective check "
            "(three all-reduces before the first step) is inside the time, its bus bandwidth in collective_check; "
            "phases_s: the master (CLI and its argument check, to the launcher's `cmd =` line), the ranks' start (to rank "
            "0's `stage: training` line), the first step (collective check, data, model, engine, step 1)"
        ),
    }
