"""Time to accuracy, offline: the demo's task trained from scratch until held-out logical-form accuracy reaches
70 %, by the defaults and by the docs-tuned peer (bench/peer.py), as a ratio (python -m bench time-to-accuracy, and
gpu-quick's time_to_accuracy).

The task is the demo's: the synthetic questions (``textsql prepare --source synthetic``, uncased input) and the
demo's model, the embedded small T5 from random weights, which the demo trains past the target
(``bench/demo_seeds.json``). A model of t5-small's shape from random weights reached no logical form at all in
100 s an arm on one H200 (``bench/gpu_quick_h200_accuracy.json``): from scratch, the target is reachable within a
short run only by the demo's model. Held out are the synthetic test split's 1,000 questions over tables no training
question uses (:func:`held_out_task` puts them where training evaluates). Both arms evaluate alike every
``eval_steps`` steps on all of them, as ``textsql train`` evaluates: greedy generation under the WikiSQL grammar
(:class:`textsql.training.trainer.GrammarGeneration`, given to the peer's trainer for its evaluation alone: a
model trained on the batch's vocabulary, as the defaults train from scratch, writes only under it), at most
:data:`GENERATION_MAX_LENGTH` tokens, in batches of ``eval_batch``, scored by
:func:`textsql.training.metrics.wikisql_metrics`. Each trains the loss it would: the defaults their own choice, the
peer T5's full-vocabulary loss. Training stops at the first evaluation that reaches the target, at the end of the
schedule (``max_steps``, the same for both) or at the first step ending ``cap_s`` after the first began
(:class:`bench.steps.StepClock` in each training process), and the figure is the training time to the target,
evaluations left out, with the wall time to it (evaluations in) beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
from transformers import AutoConfig, Seq2SeqTrainer

from bench.flops import T5Shape
from bench.machine import figure_arguments, write_figure
from bench.ours import launch_ours, probe_record, run_summary, step_samples
from bench.peer import peer_batch, peer_recipe
from bench.rank_probe import STOP_AT_VAR, TIME_CAP_VAR
from bench.steps import StepClock
from textsql.constants import DEFAULT_MODEL_DIR, PREPARE_JSON_NAME, PROJECT_DIR, UNCASED_FORMAT
from textsql.data.tables import TABLES_DIR_NAME, prepared_tables_path
from textsql.data.wikisql import recorded_input_format
from textsql.model import load_tokenizer
from textsql.training.metrics import EVAL_SPLIT, eval_questions, wikisql_metrics
from textsql.training.trainer import GrammarGeneration

logger = logging.getLogger(__name__)

TARGET_LF = 0.70
LF_METRIC = "eval_lf_accuracy"
GENERATION_MAX_LENGTH = 64  # textsql train's own generation_max_length, given to the peer too
HELD_OUT_SPLIT = "test"  # the synthetic source's 1,000 held-out questions
BATCHES_SAMPLED = 200  # the defaults' batches whose mean questions size the peer's batch
MODEL_LABEL = "the embedded small T5 (the demo's model), random weights"


@dataclass(frozen=True)
class AccuracySizes:
    """How long each arm may train, and how it is evaluated."""

    cap_s: float = 180.0  # each arm stops at the first step ending this long after its first began, evaluations in
    # An evaluation generates 1,000 queries under the grammar, which the host steps a token at a time: a GPU shortens
    # a training step far more than it, so there the arms evaluate 4 times in their 2,000 steps.
    eval_steps: int = 500
    # The schedules' length, the demo's (1,940 steps of 32 questions take it past the target): each arm's warm-up
    # and decay come within it, so the schedule ends a run that misses the target and the cap is a safety.
    max_steps: int = 2000
    eval_batch: int = 250
    limit: int | None = None  # questions a split (only the smoke run limits them)

    @property
    def needs_s(self) -> float:
        """What the figure needs of a device run's budget: both arms' caps, preparing the data, two start-ups (on one
        H200 37 s and 7 s, ``bench/gpu_quick_h200_accuracy.log``).

        :rtype: float
        """
        return 2 * self.cap_s + 60


# Two steps of the tiny T5 on 16 questions, evaluated after each: the code path, never the target.
ACCURACY_SMOKE = AccuracySizes(cap_s=60.0, eval_steps=1, max_steps=2, eval_batch=8, limit=16)
SMOKE_TOKEN_BUDGET = 2048
# A CPU's figure: about the demo's 32 questions a step (52 + 22 tokens a question), evaluated every 100 steps (there
# a step takes a tenth of a second and more), and a cap the peer's whole schedule fits in.
ACCURACY_CPU = AccuracySizes(cap_s=1200.0, eval_steps=100)
CPU_TOKEN_BUDGET = 2560
RESULT = PROJECT_DIR / "bench" / "time_to_accuracy.json"


def held_out_task(work: Path, limit: int | None) -> Path:
    """The demo's prepared questions with the held-out test split as the split training evaluates, with its tables.

    :rtype: pathlib.Path
    """
    from textsql.data.prepare import prepare

    target = work / "synthetic-held-out"
    if target.exists():
        return target
    prepared = work / "synthetic"
    if not prepared.exists():
        # One process: the bench process has CUDA and threads running by now, which forked tokenizers would inherit.
        prepare(data_dir=str(prepared), source="synthetic", input_format="uncased", limit=limit)
    loaded = datasets.load_from_disk(str(prepared))
    datasets.DatasetDict({"train": loaded["train"], EVAL_SPLIT: loaded[HELD_OUT_SPLIT]}).save_to_disk(str(target))
    shutil.copyfile(prepared / PREPARE_JSON_NAME, target / PREPARE_JSON_NAME)
    (target / TABLES_DIR_NAME).mkdir()
    for split, source in (("train", "train"), (EVAL_SPLIT, HELD_OUT_SPLIT)):
        shutil.copyfile(prepared_tables_path(prepared, source), prepared_tables_path(target, split))
    return target


def held_out_figure(sizes: AccuracySizes, work: Path) -> tuple[Path, dict]:
    """The held-out task (:func:`held_out_task`) and what a figure on it records first.

    :rtype: tuple[pathlib.Path, dict]
    """
    data = held_out_task(work, sizes.limit)
    return data, {
        "target": f"held-out logical-form accuracy >= {TARGET_LF:.0%}",
        "model": MODEL_LABEL,
        "held_out_questions": len(datasets.load_from_disk(str(data))[EVAL_SPLIT]),
        "cap_s": sizes.cap_s,
        "max_steps": sizes.max_steps,
        "eval_steps": sizes.eval_steps,
    }


def curve(record: dict) -> list[dict]:
    """Every scored evaluation of a clock record: its step, its score, the training seconds to it (from the first
    step's start, the evaluations before it left out) and the wall seconds (the evaluations in, its own too).

    :rtype: list[dict]
    """
    began = record["step_began"][0]
    points = []
    for evaluation in record["evaluations"]:
        score = evaluation["metrics"].get(LF_METRIC)
        if score is None:
            continue
        step = evaluation["step"]
        ended = record["step_ended"][step - 1] - began
        points.append(
            {
                "step": step,
                "lf_accuracy": round(score, 4),
                "training_s": round(ended - evaluating_before(record, step), 2),
                "wall_s": round(ended + evaluation["seconds"], 2),
            }
        )
    return points


def first_at(points: list[dict], score: float) -> dict | None:
    """The first point of a :func:`curve` at ``score`` or above, or None.

    :rtype: dict | None
    """
    return next((point for point in points if point["lf_accuracy"] >= score), None)


def reached(record: dict, target: float) -> dict:
    """When a clock record's evaluations first reached ``target`` (its :func:`curve`'s point); or, not reached, the
    best score and the training seconds spent. Either way with the curve.

    :rtype: dict
    """
    points = curve(record)
    first = first_at(points, target)
    if first is not None:
        return {"reached": True, **first, "curve": points}
    steps = len(record["step_ended"])
    spent = record["step_ended"][-1] - record["step_began"][0] - evaluating_before(record, steps) if steps else 0.0
    return {
        "reached": False,
        "steps": steps,
        "best_lf_accuracy": max((point["lf_accuracy"] for point in points), default=None),
        "training_s": round(spent, 2),
        "evaluations": len(record["evaluations"]),
        "curve": points,
    }


def common_score(ours: list[dict], peer: list[dict]) -> dict | None:
    """Where an arm fell short of the target: the best score both arms reached (the lower of their bests), each
    one's training seconds to it, and the peer's over the defaults'; None where either scored nothing.

    :rtype: dict | None
    """
    score = min(max((point["lf_accuracy"] for point in arm), default=0.0) for arm in (ours, peer))
    if score <= 0:
        return None
    ours_first, peer_first = first_at(ours, score), first_at(peer, score)
    assert ours_first and peer_first, "the score is at most each arm's best, so each reached it"
    return {
        "lf_accuracy": score,
        "defaults_training_s": ours_first["training_s"],
        "peer_training_s": peer_first["training_s"],
        "value": round(peer_first["training_s"] / ours_first["training_s"], 2) if ours_first["training_s"] else None,
    }


def evaluated_questions(record: dict) -> int | None:
    """How many questions a record's last evaluation scored (its runtime times its questions a second), or None."""
    if not record["evaluations"]:
        return None
    metrics = record["evaluations"][-1]["metrics"]
    return round(metrics["eval_runtime"] * metrics["eval_samples_per_second"])


def every_question_evaluated(name: str, arm: dict, held_out: int) -> None:
    """:raises RuntimeError: ``arm`` scored another number of questions than the ``held_out`` both arms must."""
    if arm["evaluated_questions"] not in (None, held_out):
        raise RuntimeError(
            f"the {name} arm evaluated {arm['evaluated_questions']} questions, not the {held_out} held out: "
            "the arms must score the same questions"
        )


def evaluating_before(record: dict, step: int) -> float:
    """Seconds spent in the evaluations that ran before step ``step`` ended (each runs after its own step's end, so
    those of earlier steps; a run's final evaluation comes after its last step).

    :rtype: float
    """
    return sum(evaluation["seconds"] for evaluation in record["evaluations"] if evaluation["step"] < step)


def evaluation_settings(sizes: AccuracySizes) -> dict:
    """What both arms evaluate with (training arguments by their names).

    :rtype: dict
    """
    return {
        "eval_strategy": "steps",
        "eval_steps": sizes.eval_steps,
        "per_device_eval_batch_size": sizes.eval_batch,
        "predict_with_generate": True,
        "generation_max_length": GENERATION_MAX_LENGTH,
    }


def defaults_to_target(
    sizes: AccuracySizes, data: Path, work: Path, token_budget: int | None, held_out: int, **flags
) -> dict:
    """``textsql launch`` on one rank with its defaults (changed only by ``flags``), evaluating as both arms do.

    :param token_budget: the budget to pass (``None``: the defaults' own for the GPU).
    :param held_out: the held-out questions, every one evaluated (``textsql train`` evaluates 64 unless told).
    :rtype: dict
    """
    began = time.monotonic()
    run_dir = launch_ours(
        work,
        "accuracy-defaults",
        DEFAULT_MODEL_DIR,
        data,
        probe_env={STOP_AT_VAR: f"{LF_METRIC}>={TARGET_LF}", TIME_CAP_VAR: str(sizes.cap_s)},
        loss_vocabulary=None,
        max_steps=sizes.max_steps,
        eval_share=0.0,  # every grid step: both arms evaluate at the same steps
        report_to="none",
        max_tokens_per_batch=token_budget,
        max_eval_samples=held_out,
        **evaluation_settings(sizes),
        **flags,
    )
    summary = run_summary(run_dir)
    record = probe_record(run_dir)
    recipe = summary["recipe"]
    return {
        "label": (
            f"defaults: textsql launch --ranks 1, recipe {recipe['name']} at {recipe['peak_learning_rate']:g}, "
            f"{summary['precision']}, "
            f"{summary['loss_vocabulary']}-vocabulary loss, token budget "
            f"{summary['token_budget']['max_tokens_per_batch']}"
        ),
        **reached(record, TARGET_LF),
        "evaluated_questions": evaluated_questions(record),
        "arm_wall_s": round(time.monotonic() - began, 1),
        "token_budget": summary["token_budget"]["max_tokens_per_batch"],
    }


# GrammarGeneration.prediction_step has Seq2SeqTrainer's signature, which Trainer's declares otherwise.
class GrammarScoredPeer(GrammarGeneration, Seq2SeqTrainer):  # type: ignore[misc]
    """The peer's ``Seq2SeqTrainer``, its training untouched, its evaluation generating under the grammar as the
    defaults' does."""


def peer_to_target(device: str, sizes: AccuracySizes, data: Path, token_budget: int) -> dict:
    """The docs' plain ``Seq2SeqTrainer`` in this process, at the defaults' questions a step, evaluating alike.

    :param token_budget: the budget the defaults trained at (their ``run.json``).
    :rtype: dict
    """
    began = time.monotonic()
    train = datasets.load_from_disk(str(data))["train"]
    lengths = ([len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]])
    shape = T5Shape.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL_DIR))
    ours = step_samples(lengths, token_budget, shape, BATCHES_SAMPLED)
    batch = min(peer_batch(statistics.fmean(step.samples for step in ours)), len(train))
    questions, tables = eval_questions(data, None)
    clock = StepClock(stop_at=(LF_METRIC, TARGET_LF), time_cap_s=sizes.cap_s)
    with tempfile.TemporaryDirectory(prefix="bench-accuracy-peer-") as output:
        record = peer_recipe(
            DEFAULT_MODEL_DIR,
            data,
            Path(output),
            clock,
            sizes.max_steps,
            device,
            batch,
            shape,
            compute_metrics=wikisql_metrics(load_tokenizer(str(DEFAULT_MODEL_DIR)), questions, tables),
            trainer_class=partial(GrammarScoredPeer, uncased=recorded_input_format(data) == UNCASED_FORMAT),
            include_for_metrics=["inputs"],
            **evaluation_settings(sizes),
        )
    return {
        "label": (
            f"peer: plain Seq2SeqTrainer as transformers' docs advise, batch {batch}, full-vocabulary loss; "
            "evaluated under the grammar, as the defaults"
        ),
        **reached(record, TARGET_LF),
        "evaluated_questions": evaluated_questions(record),
        "arm_wall_s": round(time.monotonic() - began, 1),
    }


def time_to_accuracy(
    device: str,
    sizes: AccuracySizes,
    work: Path,
    token_budget: int | None,
    save: Callable[[dict], None] = lambda figure: None,
) -> dict:
    """Both arms on the held-out task; ``save`` gets the figure after each.

    :param device: where the peer trains (``cuda`` or ``cpu``; the defaults' rank takes what the machine has).
    :param token_budget: the defaults' budget to pass (``None`` on a GPU: their own).
    :rtype: dict
    """
    data, figure = held_out_figure(sizes, work)
    held_out, figure["arms"] = figure["held_out_questions"], {}
    ours = figure["arms"]["defaults"] = defaults_to_target(sizes, data, work, token_budget, held_out)
    save(figure)
    every_question_evaluated("defaults", ours, held_out)
    peer = figure["arms"]["peer"] = peer_to_target(device, sizes, data, ours["token_budget"])
    every_question_evaluated("peer", peer, held_out)
    both = ours["reached"] and peer["reached"]
    figure["value"] = round(peer["training_s"] / ours["training_s"], 2) if both else None
    figure["unit"] = "x (the peer's training seconds to the target / the defaults')"
    if not both:
        figure["not_reached"] = [name for name, arm in figure["arms"].items() if not arm["reached"]]
        figure["common_score"] = common_score(ours["curve"], peer["curve"])
    save(figure)
    return figure


def main(argv: list[str] | None = None) -> int:
    """``python -m bench time-to-accuracy``: the figure alone, written after each arm to ``--out``."""
    args = figure_arguments(argv, "time-to-accuracy", __doc__ or "", RESULT, more=_cap_and_budget)
    sizes, token_budget = (
        (ACCURACY_SMOKE, SMOKE_TOKEN_BUDGET)
        if args.smoke
        else (ACCURACY_CPU, CPU_TOKEN_BUDGET)
        if args.device == "cpu"
        else (AccuracySizes(), None)
    )
    if args.cap_s is not None:
        sizes = dataclasses.replace(sizes, cap_s=args.cap_s)
    token_budget = args.token_budget or token_budget
    with tempfile.TemporaryDirectory(prefix="textsql-bench-") as scratch:
        time_to_accuracy(
            args.device, sizes, Path(scratch), token_budget, save=lambda figure: write_figure(args.out, figure)
        )
    return 0


def _cap_and_budget(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cap-s", type=float, help="each arm's time cap (default: the device's sizes)")
    parser.add_argument(
        "--token-budget",
        type=int,
        help=f"the defaults' tokens a step (default: {CPU_TOKEN_BUDGET} on a CPU, the defaults' own on a GPU)",
    )


if __name__ == "__main__":
    sys.exit(main())
