"""What the host spends on one training step: T5 as transformers writes it against a rank's T5
(:func:`textsql.model.speedups.speed_up_training`), with and without the bf16 weight copies.

Why: on one H200 the defaults' step kept the GPU busy 47 % of the time (``bench/gpu_quick_h200_accuracy.json``); for
the rest it waited for the host to issue the step's kernels. What issuing costs hardly depends on a model's width:
each operator pays Python, torch's dispatcher and its autograd node alike, whatever its size. ``python -m bench
host-cost`` builds t5-small's and t5-base's structure (their layers and heads) 32 wide, with a vocabulary of 512, and
steps them on the CPU, where a step's arithmetic is small, though not nothing: a CPU computes each operator before
the host issues the next (bf16 ones slowly), where a GPU would compute while the host went on.

A step is what a rank does between two batches, less the trainer and DeepSpeed's engine: forward and backward under
bf16 autocast (where the weight copies work), then torch's fused AdamW and ``zero_grad``. The arms run on the same
batch from the same seed, alternated (:func:`bench.timing.alternate`). A few more steps an arm run under
``torch.profiler``: the operators a step dispatches (:func:`bench.steps.count_ops`: the top-level ones, and the
compute ones, about a GPU kernel each), and how the median one's time splits between its top-level operators (the
dispatcher and the CPU's arithmetic) and what runs around them (Python, the autograd engine's own work, hooks), which
a GPU's host pays alike. Not in it: what CUDA adds a launch (a few microseconds).

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
from bench.steps import clock, count_ops
from bench.timeline import top_level_ops
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
    profiled_steps: int = 5


SMOKE = HostSizes(warmup=1, repetitions=2, profiled_steps=1)


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
    arms = {arm: {**times[arm], **operators(lambda arm=arm: step(arm), sizes.profiled_steps)} for arm in ARMS}
    return {
        "model": model.name,
        "arms": arms,
        "over_t5_step": {arm: round(arms[arm]["median_step_ms"] / arms["t5"]["median_step_ms"], 3) for arm in ARMS},
    }


def operators(step: Callable[[], None], steps: int) -> dict:
    """The top-level and compute operators of a call of ``step`` under ``torch.profiler``, and of ``steps`` such
    calls the median one's time: in all, inside the top-level operators, and around them (Python, the autograd
    engine's own work, hooks: what a GPU's host pays alike), each operator slowed by the profiler's own record.

    :rtype: dict
    """
    profiled = []
    for _ in range(steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            began = clock()
            step()
            wall_s = clock() - began
        events = profile.events()
        inside_s = sum(event.cpu_time_total for event in top_level_ops(events)) / 1e6
        profiled.append((wall_s, inside_s, events))
    wall_s, inside_s, events = sorted(profiled, key=lambda measured: measured[0])[steps // 2]
    counts = count_ops(events)
    return {
        "ops": counts["ops"],
        "compute_ops": counts["compute_ops"],
        "profiled_step_ms": round(1000 * wall_s, 2),
        "in_operators_ms": round(1000 * inside_s, 2),
        "around_operators_ms": round(1000 * (wall_s - inside_s), 2),
    }


def measure(sizes: HostSizes, device: str, models: list[Path]) -> dict:
    """:func:`host_arms` for each of ``models``, with how it was measured (on the CPU, whatever ``device``, in one
    torch thread: a rank's host issues its operators one after the other).

    :rtype: dict
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shapes = {model.name: host_arms(model, sizes) for model in models}
    finally:  # the caller's process (a test's worker, say) keeps its own
        torch.set_num_threads(threads)
    return {
        "figure": "host_cost",
        "shapes": shapes,
        "sizes": asdict(sizes),
        "width": WIDTH,
        "method": (
            "on the CPU, 1 torch thread(s): each model's layers and heads at {WIDTH}, built "
            f"from the same seed; the same batch of {sizes.questions} random sources of {sizes.source_tokens} tokens "
            f"and targets of {sizes.target_tokens}; a step is forward and backward under bf16 autocast, then fused "
            "AdamW and zero_grad; t5: T5ForConditionalGeneration and its loss; rank: a rank's TrainingLossT5 (the "
            "full-vocabulary loss) with speed_up_training; rank_without_weight_copies: the same without "
            f"copy_weights_at_each_forward; {sizes.warmup} rounds of warm-up, then {sizes.repetitions} rounds "
            "alternating the arms' order; median_step_ms: the median of those steps, step_ms_range the fastest and "
            f"the slowest; then {sizes.profiled_steps} steps an arm under torch.profiler, the median one's: ops and "
            "compute_ops (bench/steps.py count_ops), profiled_step_ms its time, in_operators_ms the time inside its "
            "top-level ATen operators, around_operators_ms the rest (Python, the autograd engine's own work, "
            "hooks); the profiler slows each operator by its record"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    return shapes_main(argv, "host-cost", __doc__ or "", RESULT, measure, (SMOKE, HostSizes(), HostSizes()))


if __name__ == "__main__":
    sys.exit(main())
