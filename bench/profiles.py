"""Per DeepSpeed profile on 2 CPU ranks: samples/s and peak resident memory per rank, as ratios to zero0,
next to what ``textsql estimate`` predicts.

Each profile trains a model of t5-small's shape (random weights from the config shipped in
``textsql/assets/t5-small``, the real T5 vocabulary) for a few steps through
``textsql.launching.launch.launch`` with DeepSpeed's own launcher (``--launcher local``, 2 ranks, gloo). The ranks
run :mod:`bench.rank_probe`, which runs ``textsql.training.train`` and records its peak RSS at exit; samples/s
comes from the wall times of the per-step loss events in the run's TensorBoard files.
"""

from __future__ import annotations

import logging
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import datasets

from bench.events import samples_per_second, step_wall_times
from bench.rank_probe import PROBE_DIR_VAR
from bench.tiny_run import tiny_run_argv
from textsql.constants import ASSETS_DIR, DEFAULT_MODEL_DIR
from textsql.json_files import read_json
from textsql.launching.command import LaunchArguments
from textsql.launching.launch import launch
from textsql.planning.estimate import estimate
from textsql.planning.profiles import available_profiles
from textsql.training.events import TENSORBOARD_SUBDIR
from worker.network import free_port

logger = logging.getLogger(__name__)

# In the package, so the bench runs from a checkout alone (a GPU machine, the image): see its NOTICE.
T5_SMALL_CONFIG = ASSETS_DIR / "t5-small" / "config.json"
T5_BASE_CONFIG = ASSETS_DIR / "t5-base" / "config.json"
TOKENIZER_FILES = ("spiece.model", "tokenizer.json", "tokenizer_config.json")
RANKS = 2
GIB = 1024**3


@dataclass(frozen=True)
class Sizes:
    """Steps and batch of each profile's run."""

    # Empty: every profile in dsconfig/ when the bench runs, cheapest first.
    profiles: tuple[str, ...] = ()
    steps: int = 5
    skip_steps: int = 1
    batch_size: int = 4  # per rank
    # Rounds over all profiles, in reverse order every other round, so load drifts hit them alike.
    repetitions: int = 2
    # Unmeasured launches first: the first launch of a bench ran several times slower in every run so far.
    warmup: int = 1

    def names(self) -> tuple[str, ...]:
        """The profiles to run: the ones given, else every profile in ``dsconfig/``.

        :rtype: tuple[str, ...]
        """
        return self.profiles or tuple(available_profiles())


def model_dir(work: Path, config: Path = T5_SMALL_CONFIG) -> Path:
    """A config-only model directory of ``config``'s shape (t5-small's unless told) with the embedded T5 tokenizer
    (weights built from a seed), named after the config's directory (``t5-small-shape``).

    :rtype: pathlib.Path
    """
    target = work / f"{config.parent.name}-shape"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, target / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEFAULT_MODEL_DIR / name, target / name)
    return target


def train_only(data_dir: str, work: Path) -> Path:
    """The prepared train split alone, so the runs spend no time on evaluation.

    :rtype: pathlib.Path
    """
    target = work / "train-only"
    if not target.exists():
        datasets.DatasetDict({"train": datasets.load_from_disk(data_dir)["train"]}).save_to_disk(str(target))
    return target


def launch_probed(run_dir: Path, ranks: int, train_args: list[str], what: str, env: dict | None = None) -> Path:
    """Launch ``ranks`` local ranks of ``bench.rank_probe`` (the training module, recording each rank's
    peak memory and step times) with ``train_args`` and ``env`` for the ranks, output in ``run_dir/bench.log``;
    the directory of the probes' files.

    :raises RuntimeError: naming ``what`` and the log, when the launch fails.
    :rtype: pathlib.Path
    """
    probes = run_dir / "probe"
    probes.mkdir(parents=True, exist_ok=True)
    arguments = LaunchArguments(
        run_dir=run_dir,
        launcher="local",
        ranks=ranks,
        module="bench.rank_probe",
        master_port=free_port(),
        env={PROBE_DIR_VAR: str(probes), **(env or {})},
        train_args=train_args,
    )
    with open(run_dir / "bench.log", "w", encoding="utf-8") as log:
        code = launch(arguments, stream=log)
    if code != 0:
        raise RuntimeError(f"{what} failed with exit code {code}; see {run_dir / 'bench.log'}")
    return probes


def train_args(model: Path, data: Path, output: Path, profile: str, steps: int, batch_size: int) -> list[str]:
    """``textsql train`` arguments for a short, evaluation-free run logging every step.

    :rtype: list[str]
    """
    return tiny_run_argv(
        data,
        output,
        max_steps=steps,
        eval_every=None,
        model=model,
        profile=profile,
        per_device_train_batch_size=batch_size,
        save_strategy="no",
    )


def run_profile(profile: str, model: Path, data: Path, work: Path, sizes: Sizes) -> dict:
    """One launch of ``profile`` on 2 local ranks; its samples/s and per-rank peak RSS.

    :rtype: dict
    """
    run_dir = work / profile
    shutil.rmtree(run_dir, ignore_errors=True)
    output = run_dir / "out"
    logger.info("profile %s: launching %d ranks (log in %s)", profile, RANKS, run_dir / "bench.log")
    probes = launch_probed(
        run_dir, RANKS, train_args(model, data, output, profile, sizes.steps, sizes.batch_size), f"profile {profile}"
    )
    peaks = [read_json(path)["peak_rss_bytes"] for path in sorted(probes.glob("rank*.json"))]
    if len(peaks) != RANKS:
        raise RuntimeError(
            f"profile {profile}: {len(peaks)} of {RANKS} ranks recorded their memory; see {run_dir / 'bench.log'}"
        )
    times = step_wall_times(output / TENSORBOARD_SUBDIR)
    return {
        "samples_per_s": round(samples_per_second(times, sizes.batch_size * RANKS, sizes.skip_steps), 3),
        "peak_rss_gib_per_rank": [round(peak / GIB, 3) for peak in peaks],
        "peak_rss_gib_max_rank": round(max(peaks) / GIB, 3),
    }


def run(data_dir: str, work: Path, sizes: Sizes = Sizes()) -> dict:
    """Every profile, then ratios to zero0 beside the estimate's.

    :param data_dir: a ``textsql prepare`` output.
    :param work: scratch directory for the runs.
    :rtype: dict
    """
    model = model_dir(work)
    data = train_only(data_dir, work)
    predicted = estimate(str(model), nodes=1, gpus_per_node=RANKS, gpu_memory_gb=80)
    names = sizes.names()
    for _ in range(sizes.warmup):
        run_profile(names[0], model, data, work, sizes)
    runs: dict[str, list[dict]] = {profile: [] for profile in names}
    for round_index in range(sizes.repetitions):
        for profile in names if round_index % 2 == 0 else reversed(names):
            runs[profile].append(run_profile(profile, model, data, work, sizes))
    measured = {
        profile: {
            "samples_per_s": round(statistics.median(run["samples_per_s"] for run in profile_runs), 3),
            "samples_per_s_runs": [run["samples_per_s"] for run in profile_runs],
            "peak_rss_gib_per_rank": [
                max(ranks) for ranks in zip(*(run["peak_rss_gib_per_rank"] for run in profile_runs))
            ],
            "peak_rss_gib_max_rank": max(run["peak_rss_gib_max_rank"] for run in profile_runs),
        }
        for profile, profile_runs in runs.items()
    }
    base = measured.get("zero0")
    rows = {}
    for profile, numbers in measured.items():
        estimate_row = predicted["profiles"][profile]
        # Without a GPU, device and host memory are the same RAM: the estimate's per-rank total is its
        # device share plus its share of the node's host memory.
        ram = estimate_row["gpu_gb_per_rank"] + estimate_row["cpu_gb_per_node"] / RANKS
        base_row = predicted["profiles"]["zero0"]
        base_ram = base_row["gpu_gb_per_rank"] + base_row["cpu_gb_per_node"] / RANKS
        rows[profile] = {
            **numbers,
            "samples_per_s_vs_zero0": round(numbers["samples_per_s"] / base["samples_per_s"], 2) if base else None,
            "peak_rss_vs_zero0": round(numbers["peak_rss_gib_max_rank"] / base["peak_rss_gib_max_rank"], 2)
            if base
            else None,
            "estimate_gpu_gb_per_rank": estimate_row["gpu_gb_per_rank"],
            "estimate_cpu_gb_per_node": estimate_row["cpu_gb_per_node"],
            "estimate_gpu_vs_zero0": round(estimate_row["gpu_gb_per_rank"] / base_row["gpu_gb_per_rank"], 2),
            "estimate_ram_vs_zero0": round(ram / base_ram, 2),
        }
    return {
        "parameters": predicted["parameters"],
        "profiles": rows,
        "method": (
            f"textsql.launching.launch.launch(launcher='local', ranks={RANKS}) -> deepspeed --module bench.rank_probe -> textsql.training.train; "
            f"model of t5-small's shape ({predicted['parameters'] / 1e6:.1f}M parameters, random weights, seed 42), fp32, "
            f"CPU accelerator + gloo; batch {sizes.batch_size} per rank, {sizes.steps} steps, no evaluation or checkpoints; "
            f"samples/s from the train/loss event wall times between step {sizes.skip_steps} and step {sizes.steps}; peak RSS "
            "per rank = ru_maxrss at the rank's exit (whole run, final model export included); estimate = "
            f"textsql.planning.estimate.estimate(nodes=1, gpus_per_node={RANKS}); estimate_ram = GPU share + CPU share per rank, since "
            f"both are the same RAM here; {sizes.warmup} unmeasured warm-up launch, then {sizes.repetitions} rounds over the profiles, alternating their order; median samples/s, "
            "highest peak RSS"
        ),
    }
