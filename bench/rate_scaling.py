"""The from-scratch rate at a GPU's token batches: the defaults' arm of the time to accuracy (bench/accuracy.py: the
demo's task, its held-out questions, its evaluation under the grammar) at a GPU's token budget, trained at a few peak
rates over several seeds (python -m bench rate-scaling).

The from-scratch recipe's rate, 1e-3, was chosen at the demo's batches: 2,560 tokens, about 30 questions a step. A
GPU's default budget fills 32,768 tokens a step, about 353 questions. Adam's square-root rule (Malladi et al. 2022)
scales a rate by the square root of the batch's growth: here 1e-3 x sqrt(32,768 / 2,560) = 3.58e-3. Each run trains
the embedded small T5 from random weights on one rank with the defaults, only its rate and seed given, for 905 steps
(5 epochs of the training questions at that budget: its warm-up and decay come within them), evaluates all 1,000
held-out questions every 181 steps and stops at the first evaluation at 70 % logical form or at the schedule's end.
Another budget (``--token-budget``) trains as many epochs, evaluated as often (:func:`sizes_for`).
Steps to the target are what the rates are compared by: a step does the same work at either rate, and a CPU's
seconds a step vary with what else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.accuracy import (
    ACCURACY_SMOKE,
    SMOKE_TOKEN_BUDGET,
    AccuracySizes,
    defaults_to_target,
    every_question_evaluated,
    held_out_figure,
)
from bench.machine import figure_arguments, write_figure
from textsql.constants import PROJECT_DIR
from textsql.planning.device_defaults import MAX_TOKENS_PER_BATCH
from textsql.planning.recipe import FROM_CONFIG_RECIPE, training_recipe

# 905 steps of the default budget's 32,768 tokens are 5 epochs of the synthetic training questions; evaluated 5 times,
# a CPU's cap a safety.
RATE_SIZES = AccuracySizes(cap_s=2400.0, eval_steps=181, max_steps=905)
SEEDS = (42, 7, 1)
RESULT = PROJECT_DIR / "bench" / "rate_scaling.json"


def sizes_for(token_budget: int) -> AccuracySizes:
    """:data:`RATE_SIZES` for another token budget: as many epochs (fewer steps for a larger budget), evaluated as
    often in them.

    Usage::

        >>> sizes = sizes_for(65536)
        >>> sizes.max_steps, sizes.eval_steps
        (452, 90)

    :rtype: AccuracySizes
    """
    steps = round(RATE_SIZES.max_steps * MAX_TOKENS_PER_BATCH / token_budget)
    evaluations = RATE_SIZES.max_steps // RATE_SIZES.eval_steps
    return dataclasses.replace(RATE_SIZES, max_steps=steps, eval_steps=max(1, steps // evaluations))


def rate_summary(runs: dict[str, dict]) -> dict:
    """Over a rate's runs (one a seed): how many reached the target; the steps to it, mean and range, of those that
    did; and at each evaluated step the held-out logical form's mean and range over the runs evaluated there.

    :rtype: dict
    """
    reached = [run["step"] for run in runs.values() if run["reached"]]
    scores: dict[int, list[float]] = {}
    for run in runs.values():
        for point in run["curve"]:
            scores.setdefault(point["step"], []).append(point["lf_accuracy"])
    return {
        "runs": len(runs),
        "reached": len(reached),
        "steps_to_target": (
            {"mean": round(statistics.fmean(reached)), "min": min(reached), "max": max(reached)} if reached else None
        ),
        "lf_accuracy_by_step": [
            {"step": step, "runs": len(values), "mean": round(statistics.fmean(values), 4), "min": min(values)}
            | {"max": max(values)}
            for step, values in sorted(scores.items())
        ],
    }


def rate_runs(
    sizes: AccuracySizes,
    work: Path,
    token_budget: int,
    rates: list[float],
    seeds: list[int],
    save: Callable[[dict], None] = lambda figure: None,
) -> dict:
    """Each seed at each rate, in that order (a seed's rates side by side before the next seed); ``save`` gets the
    figure after each run.

    :rtype: dict
    """
    data, figure = held_out_figure(sizes, work)
    held_out = figure["held_out_questions"]
    figure |= {"token_budget": token_budget, "rates": {f"{rate:g}": {"runs": {}} for rate in rates}}
    for seed in seeds:
        for rate in rates:
            entry = figure["rates"][f"{rate:g}"]
            run = defaults_to_target(
                sizes, data, work / f"rate-{rate:g}-seed-{seed}", token_budget, held_out, learning_rate=rate, seed=seed
            )
            every_question_evaluated(f"rate {rate:g}, seed {seed}", run, held_out)
            entry["runs"][str(seed)] = run
            entry["summary"] = rate_summary(entry["runs"])
            save(figure)
    return figure


def main(argv: list[str] | None = None) -> int:
    """``python -m bench rate-scaling``: the runs, the figure written after each to ``--out``."""
    args = figure_arguments(argv, "rate-scaling", __doc__ or "", RESULT, more=_rates_and_seeds)
    budget = args.token_budget or (SMOKE_TOKEN_BUDGET if args.smoke else MAX_TOKENS_PER_BATCH)
    sizes = ACCURACY_SMOKE if args.smoke else sizes_for(budget)
    if args.cap_s is not None:
        sizes = dataclasses.replace(sizes, cap_s=args.cap_s)
    # The defaults' rate for one rank at this budget, as textsql train chooses it; then the demo's.
    rates = args.rates or [
        training_recipe(builds_from_config=True, tokens_a_step=budget).learning_rate,
        FROM_CONFIG_RECIPE.learning_rate,
    ]
    with tempfile.TemporaryDirectory(prefix="textsql-bench-") as scratch:
        rate_runs(sizes, Path(scratch), budget, rates, args.seeds, save=lambda figure: write_figure(args.out, figure))
    return 0


def _rates_and_seeds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cap-s", type=float, help="each run's time cap (default: the sizes')")
    parser.add_argument(
        "--token-budget",
        type=int,
        help=f"tokens a step (default: {MAX_TOKENS_PER_BATCH}, a large GPU's default); another budget trains as many "
        "epochs, evaluated as often in them",
    )
    parser.add_argument(
        "--rates",
        type=_floats,
        help="peak rates, comma-separated (default: the defaults' for the budget, then the demo's 1e-3)",
    )
    parser.add_argument(
        "--seeds", type=_ints, default=list(SEEDS), help="seeds, comma-separated (default: %(default)s)"
    )


def _floats(text: str) -> list[float]:
    return [float(value) for value in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",")]


if __name__ == "__main__":
    sys.exit(main())
