"""T5's full-vocabulary training loss three ways, in the training steps of one T5 shape: with T5's logits, as
transformers computes it; in torch's own slices (``linear_cross_entropy`` with torch's default options); and in
the slices the ranks train with (:func:`textsql.training.loss.full_vocabulary_loss`).

``python -m bench sliced-loss`` builds the model once and runs the three arms on the same batch of random tokens,
alternated (:func:`bench.timing.alternate`): forward and backward, no optimizer step, under the precision the
defaults train in (bf16 autocast on CUDA, fp32 on a CPU). For each: the median step, the step's peak memory above
what was allocated before it (on CUDA the caching allocator's peak, on a CPU the allocations torch.profiler records,
those inside torch's operator included), and the loss, which the three compute alike (every step draws the same
dropout). A torch without ``linear_cross_entropy`` (before 2.13) measures the logits arm alone and says so.

Writes ``bench/sliced_loss.json`` (``--out``), t5-small's and t5-base's shapes, 256 questions a step on CUDA and 64
on a CPU; ``--smoke``: the embedded small T5 and a few steps (the tests).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import T5ForConditionalGeneration

from bench.setup_cost import BENCH_DIR
from bench.step_arms import random_batch, shapes_main, step_times, training_precision
from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.training.loss import TrainingLossT5, in_autocast_precision, training_model

RESULT = BENCH_DIR / "sliced_loss.json"
ARMS = ("t5_logits", "torch_slices", "our_slices")
Loss = Callable[[TrainingLossT5, dict], torch.Tensor]


@dataclass(frozen=True)
class LossSizes:
    """One batch of ``questions`` inputs of ``source_tokens`` and targets of ``target_tokens``, the last
    ``padded_targets`` of each padded (a batch's shorter queries)."""

    questions: int = 256
    source_tokens: int = 64
    target_tokens: int = 32
    padded_targets: int = 8
    warmup: int = 2
    repetitions: int = 8


SMOKE = LossSizes(questions=32, source_tokens=16, target_tokens=16, padded_targets=4, warmup=1, repetitions=2)
# A CPU's step of t5-base's shape at 64 questions takes seconds: the committed figure's size on a CPU.
CPU = LossSizes(questions=64, warmup=1, repetitions=4)


def torch_slices(model: TrainingLossT5, batch: dict) -> torch.Tensor:
    """The loss in torch's own slices: ``linear_cross_entropy`` with its default options, in the precision
    :func:`textsql.training.loss.full_vocabulary_loss` gives it.

    :rtype: torch.Tensor
    """
    hidden, weight = in_autocast_precision(
        model.output_layer_inputs(batch["input_ids"], None, batch["labels"]), model.lm_head.weight
    )
    return torch.nn.functional.linear_cross_entropy(
        hidden.flatten(0, 1),
        weight,
        batch["labels"].flatten(),
        ignore_index=LABEL_PAD_TOKEN_ID,
        options=torch.nn.LinearCrossEntropyOptions(),
    )


LOSSES: dict[str, Loss] = {
    "t5_logits": lambda model, batch: T5ForConditionalGeneration.forward(model, **batch).loss,
    "torch_slices": torch_slices,
    "our_slices": lambda model, batch: model(**batch).loss,
}


def peak_memory_mib(step: Callable[[], None], device: str) -> float:
    """The peak of what ``step`` allocated above what was allocated before it, in MiB.

    :rtype: float
    """
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step()
    live = peak = 0
    allocations = [event for event in recorded.profiler.kineto_results.events() if event.name() == "[memory]"]
    for event in sorted(allocations, key=lambda event: event.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return round(peak / 2**20, 1)


def loss_arms(model_dir: Path, device: str, sizes: LossSizes) -> dict:
    """The arms on ``model_dir`` (a config-only directory) on ``device``: median step, peak memory, loss, ratios.

    :rtype: dict
    """
    batch = random_batch(
        sizes.questions, sizes.source_tokens, sizes.target_tokens, device, padded_targets=sizes.padded_targets
    )
    model = training_model(model_dir, "full").to(device).train()
    arms = ARMS if hasattr(torch.nn.functional, "linear_cross_entropy") else ARMS[:1]
    losses: dict[str, float] = {}

    def step(name: str) -> None:
        torch.manual_seed(0)  # the same dropout in every arm's step: their losses compare
        with training_precision(device):
            loss = LOSSES[name](model, batch)
        loss.backward()
        losses[name] = loss.detach().item()
        model.zero_grad(set_to_none=True)

    times = step_times(step, arms, sizes.questions, sizes.repetitions, sizes.warmup)
    measured = {
        name: {
            **times[name],
            "peak_memory_mib": peak_memory_mib(lambda name=name: step(name), device),
            "loss": round(losses[name], 5),
        }
        for name in arms
    }
    figure = {
        "model": model_dir.name,
        "target_positions": batch["labels"].numel(),
        "arms": measured,
    }
    if arms != ARMS:
        return {**figure, "not_measured": f"torch {torch.__version__} has no linear_cross_entropy: only T5's logits"}
    return {**figure, **{f"{name}_over_our_slices": ratios(measured, name) for name in ARMS if name != "our_slices"}}


def ratios(measured: dict, name: str) -> dict:
    """Step time and peak memory of arm ``name`` over ours'.

    :rtype: dict
    """
    ours = measured["our_slices"]
    return {
        "step": round(measured[name]["median_step_ms"] / ours["median_step_ms"], 3),
        "peak_memory": round(measured[name]["peak_memory_mib"] / ours["peak_memory_mib"], 2),
    }


def measure(sizes: LossSizes, device: str, models: list[Path]) -> dict:
    """:func:`loss_arms` for each of ``models``, with how it was measured.

    :rtype: dict
    """
    return {
        "figure": "sliced_loss",
        "shapes": {model.name: loss_arms(model, device, sizes) for model in models},
        "sizes": asdict(sizes),
        "method": (
            f"on {device}: one model, the same batch of {sizes.questions} random sources of {sizes.source_tokens} "
            f"tokens and targets of {sizes.target_tokens} ({sizes.padded_targets} of them padded); a step is forward "
            "and backward of the full-vocabulary loss (bf16 autocast on CUDA, fp32 on a CPU), no optimizer; "
            f"{sizes.warmup} rounds of warm-up, then {sizes.repetitions} rounds alternating the arms' order; "
            "every step seeded alike (the same dropout); median_step_ms: the median of those steps, step_ms_range the "
            "fastest and the slowest; peak_memory_mib: one more step's peak allocation above what was allocated "
            "before it (CUDA: torch.cuda.max_memory_allocated; CPU: torch.profiler's memory events)"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    return shapes_main(argv, "sliced-loss", __doc__ or "", RESULT, measure, (SMOKE, CPU, LossSizes()))


if __name__ == "__main__":
    sys.exit(main())
