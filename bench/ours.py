"""The project's arm of the GPU figures: ``textsql train`` with its defaults on 1 rank through DeepSpeed's launcher,
under :mod:`bench.rank_probe`, and what its steps did.

Every run trains the full-vocabulary loss (``--loss_vocabulary full``), the loss a user with a pretrained T5
trains and the old recipe's: the bench's model is built from a config, for which ``auto`` would pick the cheaper
batch-vocabulary loss (:mod:`textsql.training.loss`), and MFU (:mod:`bench.flops`) counts the full output layer.
Samples and FLOPs of each step are rebuilt from the run's seeded token sampler.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from bench.flops import T5Shape, training_flops
from bench.old_recipe import LOSS_VOCABULARY, SEED
from bench.profiles import launch_probed
from bench.rank_probe import PROFILE_STEP_VAR
from bench.steps import timed_window
from textsql.arguments import train_argv
from textsql.constants import RUN_SUMMARY_NAME
from textsql.json_files import read_json
from textsql.training.batching import TokenBudgetBatchSampler

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether this machine has a CUDA GPU to measure.

    :rtype: bool
    """
    return torch.cuda.is_available()


def device_name(device: str) -> str:
    """The name the peak table is keyed by: CUDA's name of GPU 0, or ``"cpu"``.

    :rtype: str
    """
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def launch_ours(
    work: Path,
    name: str,
    model: Path,
    data: Path,
    profile_step: int = 0,
    probe_env: dict | None = None,
    loss_vocabulary: str | None = LOSS_VOCABULARY,
    **values,
) -> Path:
    """``textsql train`` with the defaults (changed by ``values``, see :func:`textsql.arguments.train_argv`) and the
    full-vocabulary loss on 1 rank through DeepSpeed's launcher, under :mod:`bench.rank_probe`; the run's directory.

    :param loss_vocabulary: the loss to train (``None``: the defaults' own choice).
    :raises RuntimeError: the run trained another loss than the one asked.
    :rtype: pathlib.Path
    """
    run_dir = work / name
    train_args = train_argv(
        model=str(model),
        data_dir=str(data),
        run_dir=str(run_dir / "out"),
        overwrite_output_dir=True,
        save_strategy="no",
        disable_tqdm=True,
        loss_vocabulary=loss_vocabulary,
        **values,
    )
    launch_probed(run_dir, 1, train_args, name, env={PROFILE_STEP_VAR: str(profile_step), **(probe_env or {})})
    trained = run_summary(run_dir)["loss_vocabulary"]
    if loss_vocabulary is not None and trained != loss_vocabulary:
        raise RuntimeError(
            f"{name} trained the {trained!r}-vocabulary loss, not {loss_vocabulary!r}: its FLOPs and speed do not "
            f"compare with the old recipe's; see {run_dir / 'out' / RUN_SUMMARY_NAME}"
        )
    return run_dir


def run_summary(run_dir: Path) -> dict:
    """The run's ``run.json`` (profile, precision, loss vocabulary, token budget).

    :rtype: dict
    """
    return read_json(run_dir / "out" / RUN_SUMMARY_NAME)


def probe_record(run_dir: Path) -> dict:
    """Rank 0's probe file: its step clock and peak memory (:mod:`bench.rank_probe`).

    :rtype: dict
    """
    return read_json(run_dir / "probe" / "rank0.json")


def peak_memory(record: dict) -> tuple[int, str]:
    """A rank's peak memory in bytes and how it was read: torch's high-water mark of allocated CUDA memory, or on
    a CPU the rank's peak RSS.

    :rtype: tuple[int, str]
    """
    if record["cuda_max_memory_allocated_bytes"] is not None:
        return record["cuda_max_memory_allocated_bytes"], "cuda_max_memory_allocated"
    return record["peak_rss_bytes"], "peak_rss (the rank)"


class StepWork(NamedTuple):
    """What one training step (or, as rates, one second) did: samples, real-token FLOPs and real tokens (each
    sample's input and labels at their own lengths, the padding left out)."""

    samples: float
    flops: float
    tokens: float


def step_samples(
    lengths: tuple[list[int], list[int]], budget: int, shape: T5Shape, steps: int, compiled: bool = False
) -> list[StepWork]:
    """The work of each step 1..``steps`` of a 1-rank token-budget run, rebuilt from its seeded sampler.

    :param compiled: the run trained under torch.compile (its sampler's compiled mode).
    :rtype: list[StepWork]
    """
    sampler = TokenBudgetBatchSampler(*lengths, budget, seed=SEED, compiled=compiled)
    per_step = []
    for epoch in range(-(-steps // len(sampler))):
        for batch in sampler.epoch_batches(epoch):
            flops = sum(training_flops(shape, lengths[0][i], lengths[1][i]) for i in batch)
            per_step.append(StepWork(len(batch), flops, sum(lengths[0][i] + lengths[1][i] for i in batch)))
    return per_step[:steps]


def throughput(record: dict, per_step: list[StepWork], skip: int) -> StepWork:
    """Samples/s, real FLOP/s and real tokens/s over the timed window of a clock record
    (:func:`bench.steps.timed_window`).

    :param per_step: the work of every step from the first.
    :rtype: StepWork
    """
    steps, seconds = timed_window(record, skip)
    done = per_step[skip : skip + steps]
    return StepWork(*(sum(values) / seconds for values in zip(*done, strict=True)))
