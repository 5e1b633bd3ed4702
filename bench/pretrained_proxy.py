"""``python -m bench pretrained-proxy``: a CPU proxy for "the with-weights recipe does not wreck a pretrained model".

No pretrained T5 is in reach here, so one is made: the embedded small T5, trained from random weights on the
synthetic questions (``synthetic-select``, uncased, the learning check's data) at the demo's recipe, stands for
the "pretrained" model; it reads headers it never saw. That model is then fine-tuned on another distribution,
the shipped real sample, in two arms that differ only in their learning-rate recipe:

- ``recipe``: no rate flags, so the model directory with weights gets the with-weights recipe
  (:data:`textsql.planning.recipe.WITH_WEIGHTS_RECIPE`: AdamW 3e-4, linear warm-up, linear decay);
- ``constant``: the from-scratch recipe forced by flags (AdamW at a constant 1e-3, no warm-up).

What it keeps: the held-out synthetic accuracy (logical form and select, as ``textsql evaluate`` scores them)
after the fine-tuning, against the "pretrained" model's; the first steps' loss against the first step's, which
is the pretrained weights' loss on the new data (both arms see the same batches in the same order). What it
learns: the held-out real accuracy and the last steps' training loss.

Every run is ``python -m textsql.training.train`` (one DeepSpeed rank, profile zero0). Both phases train the
batch-vocabulary loss (:mod:`textsql.training.loss`): the stand-in was pretrained with it, and switching to the
full softmax would raise the first steps' loss by itself, whatever the rate.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from transformers import DataCollatorForSeq2Seq

from bench.tiny_run import tiny_run_argv
from textsql.arguments import PrepareArguments
from textsql.constants import LABEL_PAD_TOKEN_ID, RUN_SUMMARY_NAME, SAMPLE_SOURCE, UNCASED_FORMAT
from textsql.data.prepare import prepare
from textsql.data.wikisql import SYNTHETIC_SELECT_SOURCE
from textsql.inference.predict import predict
from textsql.json_files import read_json
from textsql.model import load_tokenizer
from textsql.planning.recipe import FROM_CONFIG_RECIPE
from textsql.training.loss import training_model

logger = logging.getLogger(__name__)

PROFILE = "zero0"
# The from-scratch recipe given as flags: the with-weights model then trains as a model from random weights does.
CONSTANT_FLAGS = {
    "learning_rate": FROM_CONFIG_RECIPE.learning_rate,
    "lr_scheduler_type": FROM_CONFIG_RECIPE.schedule,
    "warmup_steps": FROM_CONFIG_RECIPE.warmup,
}
ARMS = {"recipe": {}, "constant": CONSTANT_FLAGS}
RUN_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Sizes:
    """The "pretraining", the fine-tuning of each arm, and how many held-out questions each accuracy is scored on:
    sized to end in about 10 minutes on two idle cores (the learning check's 700 steps of 64 questions reach a
    held-out logical form of about 0.5; these 300 of 32 stop well short of it)."""

    pretrain_steps: int = 300
    pretrain_batch: int = 32
    finetune_steps: int = 60
    finetune_batch: int = 16
    first_steps: int = 10
    heldout_questions: int = 64

    @classmethod
    def small(cls) -> Sizes:
        """What a loaded shared machine finishes in about 15 minutes (``--small``): accuracies stay near their
        floor at this size, the losses still move.

        :rtype: Sizes
        """
        return cls(
            pretrain_steps=80,
            pretrain_batch=16,
            finetune_steps=30,
            finetune_batch=8,
            first_steps=5,
            heldout_questions=32,
        )


def train(model: str | Path, data: Path, output: Path, steps: int, batch: int, **flags: object) -> dict:
    """One rank of ``textsql train``, logging every step, without evaluation or checkpoints; its run.json.

    :raises RuntimeError: naming the log, when the run fails.
    :rtype: dict
    """
    argv = tiny_run_argv(
        data,
        output,
        max_steps=steps,
        eval_every=None,
        model=str(model),
        profile=PROFILE,
        per_device_train_batch_size=batch,
        loss_vocabulary="batch",
        save_strategy="no",
        # The final evaluation scores the loss only: the held-out accuracies are scored here, on both sources.
        predict_with_generate=False,
        **flags,
    )
    output.mkdir(parents=True, exist_ok=True)
    log = output / "proxy.log"
    with open(log, "w", encoding="utf-8") as stream:
        result = subprocess.run(
            [sys.executable, "-m", "textsql.training.train", *argv],
            stdout=stream,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"training {output.name} failed with exit code {result.returncode}; see {log}")
    return read_json(output / RUN_SUMMARY_NAME)


def heldout(model: Path, data: Path, questions: int, out: Path) -> dict:
    """Logical-form and select accuracy and the loss of ``model`` on the first ``questions`` validation questions
    of ``data``.

    :rtype: dict
    """
    metrics = predict(model, data, "validation", out=out, limit=questions, progress=False)["metrics"]
    return {
        "lf_accuracy": metrics["lf_accuracy"],
        "select": metrics["components"]["sel"],
        "loss": heldout_loss(model, data, questions),
    }


def heldout_loss(model: Path, data: Path, questions: int) -> float:
    """The training loss (batch vocabulary, as both phases train) of ``model`` on the first ``questions`` validation
    questions of ``data``: it moves where accuracy, near 0 or near 1, cannot.

    :rtype: float
    """
    split = datasets.load_from_disk(str(data))["validation"]
    rows = split.select(range(min(questions, len(split)))).select_columns(["input_ids", "attention_mask", "labels"])
    batch = DataCollatorForSeq2Seq(load_tokenizer(model), label_pad_token_id=LABEL_PAD_TOKEN_ID)(list(rows))
    scored = training_model(model, "batch")
    # Training mode picks the batch-vocabulary loss; the small T5 has no dropout, so nothing is random.
    scored.train()
    with torch.no_grad():
        return round(float(scored(**batch).loss), 4)


def step_losses(summary: dict) -> list[float]:
    """The training loss logged at each step, in order (``logging_steps`` 1).

    :rtype: list[float]
    """
    return [entry["loss"] for entry in summary["log_history"] if "loss" in entry]


def first_steps(losses: list[float], count: int) -> dict:
    """The first step's loss (the starting weights' on the new data), and the highest and the mean of the next
    ``count`` against it.

    :rtype: dict
    """
    start, following = losses[0], losses[1 : count + 1]
    return {
        "start_loss": round(start, 4),
        "peak_loss": round(max(following), 4),
        "peak_over_start": round(max(following) / start, 3),
        "mean_over_start": round(sum(following) / len(following) / start, 3),
    }


def run(work: Path, sizes: Sizes = Sizes()) -> dict:
    """Pretrain the stand-in, fine-tune it in both arms, score them; the figures by arm, with ratios.

    :rtype: dict
    """
    synthetic, real = work / "synthetic", work / "real"
    for out, source in ((synthetic, SYNTHETIC_SELECT_SOURCE), (real, SAMPLE_SOURCE)):
        if not out.exists():
            prepare(PrepareArguments(data_dir=str(out), source=source, input_format=UNCASED_FORMAT))
    started = time.monotonic()
    pretrained_run = work / "pretrained"
    pretraining = train("default", synthetic, pretrained_run, sizes.pretrain_steps, sizes.pretrain_batch)
    pretrained = pretrained_run / "model"
    logger.info("pretrained in %.0f s (recipe %s)", time.monotonic() - started, pretraining["recipe"]["name"])
    questions = sizes.heldout_questions
    results: dict = {
        "sizes": asdict(sizes),
        "pretrained": {
            "recipe": pretraining["recipe"]["name"],
            "synthetic": heldout(pretrained, synthetic, questions, work / "pretrained-synthetic.jsonl"),
            "real": heldout(pretrained, real, questions, work / "pretrained-real.jsonl"),
        },
        "arms": {},
    }
    for arm, flags in ARMS.items():
        output = work / f"finetune-{arm}"
        summary = train(pretrained, real, output, sizes.finetune_steps, sizes.finetune_batch, **flags)
        losses = step_losses(summary)
        results["arms"][arm] = {
            "recipe": summary["recipe"],
            "synthetic": heldout(output / "model", synthetic, questions, output / "synthetic.jsonl"),
            "real": heldout(output / "model", real, questions, output / "real.jsonl"),
            "first_steps": first_steps(losses, sizes.first_steps),
            "last_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        }
        logger.info("arm %s done at %.0f s", arm, time.monotonic() - started)
    results["seconds"] = round(time.monotonic() - started)
    return results


def table(results: dict) -> str:
    """The figures as a table: each arm beside the "pretrained" model, and the recipe arm over the constant one.

    :rtype: str
    """
    pretrained, arms = results["pretrained"], results["arms"]
    recipe, constant = arms["recipe"], arms["constant"]
    rows = [
        (
            "held-out synthetic LF (kept)",
            pretrained["synthetic"]["lf_accuracy"],
            *_pair(arms, "synthetic", "lf_accuracy"),
        ),
        ("held-out synthetic select (kept)", pretrained["synthetic"]["select"], *_pair(arms, "synthetic", "select")),
        ("held-out synthetic loss (kept)", pretrained["synthetic"]["loss"], *_pair(arms, "synthetic", "loss")),
        ("held-out real loss (learned)", pretrained["real"]["loss"], *_pair(arms, "real", "loss")),
        ("held-out real LF (learned)", pretrained["real"]["lf_accuracy"], *_pair(arms, "real", "lf_accuracy")),
        ("held-out real select (learned)", pretrained["real"]["select"], *_pair(arms, "real", "select")),
        ("first step's loss", None, *_pair(arms, "first_steps", "start_loss")),
        ("peak / first step's loss", None, *_pair(arms, "first_steps", "peak_over_start")),
        ("mean / first step's loss", None, *_pair(arms, "first_steps", "mean_over_start")),
        ("last 10 steps' loss", None, recipe["last_loss"], constant["last_loss"]),
    ]
    lines = [
        f"{'':34} {'pretrained':>10} {'recipe':>10} {'constant':>10} {'recipe/constant':>16}",
        *(
            f"{name:34} {_cell(start):>10} {_cell(ours):>10} {_cell(theirs):>10} "
            f"{_cell(ours / theirs if theirs else None):>16}"
            for name, start, ours, theirs in rows
        ),
        (
            f"recipe: {recipe['recipe']['name']} (peak {recipe['recipe']['peak_learning_rate']}, "
            f"{recipe['recipe']['schedule']}, warm-up {recipe['recipe']['warmup_steps']}); constant: "
            f"{constant['recipe']['peak_learning_rate']} {constant['recipe']['schedule']}, warm-up "
            f"{constant['recipe']['warmup_steps']}; {results['seconds']} s"
        ),
    ]
    return "\n".join(lines)


def _pair(arms: dict, group: str, key: str) -> tuple[float, float]:
    return arms["recipe"][group][key], arms["constant"][group][key]


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    """Run the proxy, print its table, write its JSON.

    :rtype: int
    """
    parser = argparse.ArgumentParser(prog="python -m bench pretrained-proxy", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--pretrain-steps", type=int, default=Sizes.pretrain_steps)
    parser.add_argument("--finetune-steps", type=int, default=Sizes.finetune_steps)
    parser.add_argument("--small", action="store_true", help="the smallest sizes that still tell the losses apart")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sizes = (
        Sizes.small() if args.small else Sizes(pretrain_steps=args.pretrain_steps, finetune_steps=args.finetune_steps)
    )
    with tempfile.TemporaryDirectory(prefix="textsql-proxy-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        results = run(work, sizes)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
