"""The checkpoint store's cost: upload seconds per checkpoint, step time with and without the store, and resuming
from the store against resuming from the local run directory.

``textsql launch --launcher local --ranks 2`` trains the embedded small T5 (profile zero1, batch 8 per rank, every
step logged, a checkpoint every ``save_steps``) with and without ``--checkpoint-store s3://...`` on a real S3 server
on this machine (SeaweedFS, :mod:`bench.seaweed`), the arms alternated. A step's time is the mean over the run's
steps after the first, from the loss events' wall times, checkpoint saves included; the uploads' bytes and
seconds are the ones the run records in ``run.json``. Then one more step is trained from the newest checkpoint
twice: from the run directory as it is, and from the store alone (the run directory deleted); each is timed from
the command to that step's loss event.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.events import step_wall_times
from bench.profiles import train_only
from bench.seaweed import BUCKET, S3Server, s3_server
from bench.startup import local_launch
from bench.timing import summary
from bench.tiny_run import tiny_run_argv
from textsql.constants import RUN_SUMMARY_NAME
from textsql.json_files import read_json
from textsql.training.events import TENSORBOARD_SUBDIR

logger = logging.getLogger(__name__)

PROFILE = "zero1"
RANKS = 2
DOWNLOADED = re.compile(r"checkpoint-\d+ downloaded from \S+ in (?P<seconds>[\d.]+) s")


@dataclass(frozen=True)
class Sizes:
    """``repetitions`` rounds of both arms (alternated), each a run of ``steps`` with a checkpoint every
    ``save_steps``."""

    steps: int = 10
    save_steps: int = 2
    repetitions: int = 2


def launch(run_dir: Path, train_args: list[str], env: dict[str, str], store: str | None) -> tuple[float, str]:
    """One ``textsql launch`` of 2 local ranks into ``run_dir`` (the ranks' run directory); its start time and output.

    :rtype: tuple[float, str]
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    store_option = ["--checkpoint-store", store] if store else []
    command = local_launch(run_dir, RANKS, train_args, *store_option, verbose=True)
    started = time.time()
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=900)
    (run_dir / "bench.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"textsql launch failed with exit code {done.returncode}; see {run_dir / 'bench.log'}")
    return started, done.stdout + done.stderr


def train(data: Path, output: Path, steps: int, save_steps: int, **values: object) -> list[str]:
    """The arms' training arguments."""
    return tiny_run_argv(
        data, output, max_steps=steps, eval_every=None, profile=PROFILE, per_device_train_batch_size=8,
        save_steps=save_steps, **values,
    )  # fmt: skip


def step_seconds(output: Path) -> float:
    """Mean seconds a step took after the first (checkpoint saves included).

    :rtype: float
    """
    times = step_wall_times(output / TENSORBOARD_SUBDIR)
    return (times[-1][1] - times[0][1]) / (len(times) - 1)


def first_step_after(output: Path, step: int, started: float) -> float:
    """Seconds from ``started`` to the loss event of ``step``.

    :rtype: float
    """
    return next(wall for logged, wall in step_wall_times(output / TENSORBOARD_SUBDIR) if logged == step) - started


def run(data_dir: str, work: Path, sizes: Sizes = Sizes()) -> dict:
    """Measure both arms and both resumes (see the module docstring).

    :rtype: dict
    """
    data = train_only(data_dir, work)
    with s3_server(work / "s3") as server:
        return _measure(server, data, work, sizes)


def _measure(server: S3Server, data: Path, work: Path, sizes: Sizes) -> dict:
    env = os.environ | server.environ() | {"OMP_NUM_THREADS": "1"}
    steps: dict[str, list[float]] = {"without_store": [], "with_store": []}
    uploads: list[dict] = []
    for index in range(sizes.repetitions):
        for arm in list(steps) if index % 2 == 0 else reversed(list(steps)):
            run_dir, store = work / f"store-{arm}-{index}", f"s3://{BUCKET}/bench/{arm}-{index}"
            output = run_dir / "out"
            launch(output, train(data, output, sizes.steps, sizes.save_steps), env, store if "with" in arm else None)
            steps[arm].append(step_seconds(output))
            if arm == "with_store":
                uploads += read_json(output / RUN_SUMMARY_NAME)["checkpoint_store"]["checkpoints"]
    # One more step from the newest checkpoint of the last store run: from its directory, then from the store alone.
    resumed = train(data, output, sizes.steps + 1, sizes.save_steps, resume_from_checkpoint="auto")
    started, _ = launch(output, resumed, env, None)
    from_disk = first_step_after(output, sizes.steps + 1, started)
    shutil.rmtree(output)
    started, said = launch(output, resumed, env, store)
    from_store = first_step_after(output, sizes.steps + 1, started)
    downloaded = DOWNLOADED.search(said)
    upload_seconds = [entry["seconds"] for entry in uploads]
    ratio = statistics.median(steps["with_store"]) / statistics.median(steps["without_store"])
    logger.info("store: step-time ratio %.3f, resume from store %.1f s, from disk %.1f s", ratio, from_store, from_disk)
    return {
        "value": round(ratio, 3),
        "unit": "x (step seconds with the store / without)",
        "goal": None,
        "step_seconds": {arm: summary(values, 3) for arm, values in steps.items()},
        "upload_seconds_per_checkpoint": summary(upload_seconds, 3),
        "upload_megabytes_per_checkpoint": round(statistics.median(entry["bytes"] for entry in uploads) / 1e6, 1),
        "resume_to_first_step_s": {"from_local_disk": round(from_disk, 1), "from_store": round(from_store, 1)},
        "resume_store_over_disk": round(from_store / from_disk, 2),
        "download_s": float(downloaded["seconds"]) if downloaded else None,
        "method": (
            f"`textsql launch --launcher local --ranks {RANKS}`, embedded small T5, profile {PROFILE}, batch 8 per rank, "
            f"{sizes.steps} steps, a checkpoint every {sizes.save_steps}; without and with --checkpoint-store s3:// on a "
            f"SeaweedFS server on this machine (loopback), {sizes.repetitions} rounds alternating the arms; step seconds: "
            "mean over the steps after the first from the loss events' wall times (saves included), median of the runs; "
            "upload seconds: run.json's checkpoint_store record, every checkpoint of the store runs; resume: one more "
            "step from the last store run's newest checkpoint, from its run directory and then from the store alone "
            "(run directory deleted), command start to that step's loss event, one run each"
        ),
    }
