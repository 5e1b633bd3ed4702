"""What the host spends issuing one training step: T5 as transformers writes it against a rank's T5
(:func:`textsql.model.speedups.speed_up_training`), with and without the bf16 weight copies.

Why: on one H200 the defaults' step kept the GPU busy 47 % of the time (``bench/gpu_quick_h200_accuracy.json``); for
the rest it waited for the host to issue the step's kernels. What issuing costs does not depend on a model's width:
each operator pays Python, torch's dispatcher and its autograd node alike, whatever its size. ``python -m bench
host-cost`` builds t5-small's and t5-base's structure (their layers and heads) 32 wide, with a vocabulary of 512, and
steps them on the CPU, where a step's arithmetic is then small and its wall time is mostly what issuing it costs.

A step is what a rank does between two batches, less the trainer and DeepSpeed's engine: forward and backward under
bf16 autocast (where the weight copies work), then torch's fused AdamW and ``zero_grad``. The arms run on the same
batch from the same seed, alternated (:func:`bench.timing.alternate`). Each arm's operators a step come from one more
step under ``torch.profiler`` (:func:`bench.steps.count_ops`): the top-level ones, and the compute ones that a GPU
launches a kernel for, about. Not in it: what CUDA adds a launch (a few microseconds), and what a step's kernels
cost on a GPU.

Writes ``bench/host_cost.json`` (``--out``); ``--smoke``: the embedded small T5's structure, a few steps (the tests).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.setup_cost import BENCH_DIR
from bench.step_arms import shapes_main, step_times
from bench.steps import count_ops
from textsql.model import load_model
from textsql.model.speedups import (
    fuse_norms,
    fuse_projections,
    share_attention_bias,
    skip_feed_forward_upcast,
    speed_up_training,
)
from textsql.training.loss import training_model

RESULT = BENCH_DIR / "host_cost.json"
ARMS = ("t5", "rank_without_weight_copies", "rank")
# Narrow enough that a CPU step's arithmetic is small beside its operators' cost, the structure kept.
WIDTH = {"d_model": 32, "d_kv": 4, "d_ff": 64, "vocab_size": 512}


@dataclass(frozen=True)
class HostSizes:
    """One batch of ``questions`` random sources of ``source_tokens`` and targets of ``target_tokens``."""

    questions: int = 4
    source_tokens: int = 16
    target_tokens: int = 16
    warmup: int = 10
    repetitions: int = 60


SMOKE = HostSizes(warmup=1, repetitions=2)


def narrow(model: Path, work: Path) -> Path:
    """A config-only directory of ``model``'s structure at :data:`WIDTH`.

    :rtype: pathlib.Path
    """
    config = json.loads((model / "config.json").read_text()) | WIDTH
    target = work / f"{model.name}-narrow"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config))
    return target


def build(arm: str, model: Path) -> torch.nn.Module:
    """The arm's model from ``model``'s seed: T5 with its own loss, or a rank's (its loss over the full vocabulary)
    with every change but the weight copies, or with all.

    :rtype: torch.nn.Module
    """
    if arm == "t5":
        return load_model(model).train()
    rank_t5 = training_model(model, "full").train()
    if arm == "rank":
        speed_up_training(rank_t5)
    else:
        for change in (fuse_norms, skip_feed_forward_upcast, share_attention_bias, fuse_projections):
            change(rank_t5)
    return rank_t5


def host_arms(model: Path, sizes: HostSizes) -> dict:
    """Every arm on ``model``'s structure, narrowed: median step, operators a step, and each arm's step over T5's.

    :rtype: dict
    """
    with tempfile.TemporaryDirectory(prefix="bench-host-cost-") as work:
        narrowed = narrow(model, Path(work))
        models = {arm: build(arm, narrowed) for arm in ARMS}
    optimizers = {arm: torch.optim.AdamW(models[arm].parameters(), lr=1e-4, fused=True) for arm in ARMS}
    generator = torch.Generator().manual_seed(0)
    batch = {  # token ids past T5's special ones, within the narrowed vocabulary
        name: torch.randint(5, WIDTH["vocab_size"], (sizes.questions, tokens), generator=generator)
        for name, tokens in (("input_ids", sizes.source_tokens), ("labels", sizes.target_tokens))
    }

    def step(arm: str) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models[arm](**batch).loss
        loss.backward()
        optimizers[arm].step()
        optimizers[arm].zero_grad(set_to_none=True)

    times = step_times(step, ARMS, sizes.questions, sizes.repetitions, sizes.warmup)
    arms = {arm: {**times[arm], **operators(lambda arm=arm: step(arm))} for arm in ARMS}
    return {
        "model": model.name,
        "arms": arms,
        "over_t5_step": {arm: round(arms[arm]["median_step_ms"] / arms["t5"]["median_step_ms"], 3) for arm in ARMS},
    }


def operators(step: Callable[[], None]) -> dict:
    """The top-level and compute operators of one call of ``step``, under ``torch.profiler``.

    :rtype: dict
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    counts = count_ops(profile.events())
    return {"ops": counts["ops"], "compute_ops": counts["compute_ops"]}


def measure(sizes: HostSizes, device: str, models: list[Path]) -> dict:
    """:func:`host_arms` for each of ``models``, with how it was measured (on the CPU, whatever ``device``, in one
    torch thread: a rank's host issues its operators one after the other).

    :rtype: dict
    """
    torch.set_num_threads(1)
    return {
        "figure": "host_cost",
        "shapes": {model.name: host_arms(model, sizes) for model in models},
        "sizes": asdict(sizes),
        "width": WIDTH,
        "method": (
            f"on the CPU, {torch.get_num_threads()} torch thread(s): each model's layers and heads at {WIDTH}, built "
            f"from the same seed; the same batch of {sizes.questions} random sources of {sizes.source_tokens} tokens "
            f"and targets of {sizes.target_tokens}; a step is forward and backward under bf16 autocast, then fused "
            "AdamW and zero_grad; t5: T5ForConditionalGeneration and its loss; rank: a rank's TrainingLossT5 (the "
            "full-vocabulary loss) with speed_up_training; rank_without_weight_copies: the same without "
            f"copy_weights_at_each_forward; {sizes.warmup} rounds of warm-up, then {sizes.repetitions} rounds "
            "alternating the arms' order; median_step_ms: the median of those steps, step_ms_range the fastest and "
            "the slowest; ops and compute_ops: one more step under torch.profiler (bench/steps.py count_ops)"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    return shapes_main(argv, "host-cost", __doc__ or "", RESULT, measure, (SMOKE, HostSizes(), HostSizes()))


if __name__ == "__main__":
    sys.exit(main())
