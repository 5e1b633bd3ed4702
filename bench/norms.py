"""T5's own norm against torch's ``RMSNorm`` (:func:`textsql.model.speedups.fuse_norms`, what the ranks and the
predictor train and generate with) in the training steps of one T5 shape.

``python -m bench norms`` builds the model twice from the same seed, swaps the norms of one, and runs both on the
same batch of random tokens, alternated (:func:`bench.timing.alternate`): forward and backward of the
full-vocabulary loss, no optimizer step (the norms do all their work in these), under the precision the defaults
train in (bf16 autocast on CUDA, fp32 on a CPU). For each: the median step, and a timeline of a few more steps
(:mod:`bench.timeline`: on CUDA the kernels a step launches and how busy they kept the GPU; on a CPU the top-level
ATen operators). gpu-quick runs the same as its ``norms`` arm on t5-small's shape.

Writes ``bench/norms.json`` (``--out``), t5-small's and t5-base's shapes, 64 questions a step on CUDA and 8 on a CPU;
``--smoke``: the embedded small T5 and a few steps (the tests).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.setup_cost import BENCH_DIR
from bench.step_arms import random_batch, shapes_main, step_times, training_precision
from bench.timeline import profiled
from textsql.model import load_model
from textsql.model.speedups import fuse_norms

RESULT = BENCH_DIR / "norms.json"
ARMS = ("t5_norms", "fused_norms")


@dataclass(frozen=True)
class NormSizes:
    """One batch of ``questions`` inputs of ``source_tokens`` and targets of ``target_tokens`` (the shipped
    sample's schema inputs are about 60 tokens, their queries about 20)."""

    questions: int = 64
    source_tokens: int = 64
    target_tokens: int = 24
    warmup: int = 2
    repetitions: int = 8
    profiled_steps: int = 2


SMOKE = NormSizes(questions=4, source_tokens=16, target_tokens=8, warmup=1, repetitions=2, profiled_steps=1)
# A CPU's step of t5-base's shape takes seconds at 8 questions: the committed figure's size on a CPU.
CPU = NormSizes(questions=8)


def norm_arms(model: Path, device: str, sizes: NormSizes) -> dict:
    """Both arms on ``model`` (a config-only directory) on ``device``: median step, timelines and their ratios.

    :rtype: dict
    """
    batch = random_batch(sizes.questions, sizes.source_tokens, sizes.target_tokens, device)
    models = {name: load_model(model).to(device).train() for name in ARMS}
    swapped = fuse_norms(models["fused_norms"])

    def step(name: str) -> None:
        with training_precision(device):
            loss = models[name](**batch).loss
        loss.backward()
        models[name].zero_grad(set_to_none=True)

    times = step_times(step, ARMS, sizes.questions, sizes.repetitions, sizes.warmup)
    arms = {
        name: {**times[name], "timeline": timeline(lambda name=name: step(name), sizes.profiled_steps)} for name in ARMS
    }
    before, after = (arms[name]["timeline"]["kernels_per_step"] for name in ARMS)
    return {
        "model": model.name,
        "norms_swapped": swapped,
        "arms": arms,
        "t5_norms_over_fused_step": round(
            arms["t5_norms"]["median_step_ms"] / arms["fused_norms"]["median_step_ms"], 3
        ),
        "kernels_per_step_saved": round(before - after, 1),
    }


def timeline(step: Callable[[], None], steps: int) -> dict:
    """:func:`bench.timeline.summarize` of ``steps`` calls of ``step``.

    :rtype: dict
    """
    with profiled(steps) as summary:
        for _ in range(steps):
            step()
    return summary


def measure(sizes: NormSizes, device: str, models: list[Path]) -> dict:
    """:func:`norm_arms` for each of ``models``, with how it was measured.

    :rtype: dict
    """
    return {
        "figure": "norms",
        "shapes": {model.name: norm_arms(model, device, sizes) for model in models},
        "sizes": asdict(sizes),
        "method": (
            f"on {device}: each arm's model built from the same seed, the same batch of {sizes.questions} random "
            f"sources of {sizes.source_tokens} tokens and targets of {sizes.target_tokens}; a step is forward and "
            "backward of T5's own full-vocabulary loss (bf16 autocast on CUDA, fp32 on a CPU), no optimizer; "
            f"{sizes.warmup} rounds of warm-up, then {sizes.repetitions} rounds alternating the arms' order; "
            "median_step_ms: the median of those steps, step_ms_range the fastest and the slowest; timeline: "
            f"{sizes.profiled_steps} more steps under torch.profiler (bench/timeline.py: on CUDA the device's "
            "kernels, on a CPU the top-level ATen operators)"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    return shapes_main(argv, "norms", __doc__ or "", RESULT, measure, (SMOKE, CPU, NormSizes()))


if __name__ == "__main__":
    sys.exit(main())
