"""The peer a user would otherwise run: a plain ``Seq2SeqTrainer`` script tuned as transformers' docs advise today
("Efficient training on a single GPU"): bf16 and TF32 on CUDA, ``optim="adamw_torch_fused"``, length-grouped
sampling (``train_sampling_strategy="group_by_length"``, what ``group_by_length=True`` became in transformers 5),
dynamic padding with ``DataCollatorForSeq2Seq`` (to a multiple of 8 on CUDA, for the tensor cores), and a large
per-device batch.

It trains in the bench's process, as the old recipe does (:mod:`bench.old_recipe`), on the same model and data,
under the same :class:`bench.steps.StepClock`. Its batches are as many questions as the length grouping puts
together, so the work of each step is recorded as its collator pads it (:class:`RecordingCollator`): the
dataloader collates in this process (no loader workers, the Trainer's default) and in step order, so the n-th
batch padded is the n-th step's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

from bench.flops import T5Shape, training_flops
from bench.old_recipe import EVAL_BATCH, LOSS_VOCABULARY, SEED, train_measured
from bench.ours import StepWork
from bench.steps import StepClock
from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.model import load_model, load_tokenizer

logger = logging.getLogger(__name__)

# DataCollatorForSeq2Seq's docs: padding to a multiple of 8 lets tensor cores run (run_translation pads so in fp16).
PAD_MULTIPLE = 8
# The from-scratch rate of the old recipe and of our defaults, with our token-batch recipe's warm-up share (a
# fraction: transformers 5 reads warmup_steps below 1 as a ratio), then the Trainer's own linear decay.
LEARNING_RATE = 1e-3
WARMUP_SHARE = 0.06


def label(batch: int, device: str) -> str:
    """What the arm is, for tables and JSON.

    :rtype: str
    """
    precision = "bf16 autocast, TF32" if device == "cuda" else "fp32 (bf16 and TF32 on CUDA only)"
    return (
        f"peer: plain Seq2SeqTrainer as transformers' docs advise, in the bench process, eager, {precision}, "
        f"adamw_torch_fused at {LEARNING_RATE:g} ({WARMUP_SHARE:.0%} warm-up, linear decay), batch {batch} grouped "
        f"by length, padded per batch by DataCollatorForSeq2Seq, {LOSS_VOCABULARY}-vocabulary loss"
    )


def peer_batch(samples_per_step: float) -> int:
    """The peer's per-device batch: the defaults' mean questions a step at their token budget, down to a multiple of
    :data:`PAD_MULTIPLE` (at least that), so both arms put as many questions in a step and the comparison is of
    how each fills and runs it.

    :rtype: int
    """
    return max(PAD_MULTIPLE, int(samples_per_step) // PAD_MULTIPLE * PAD_MULTIPLE)


class RecordingCollator:
    """``DataCollatorForSeq2Seq`` that records, for every batch it pads, its questions, their real-token FLOPs and
    their real tokens (input and labels at their own lengths), in the order it pads them."""

    def __init__(self, collator: DataCollatorForSeq2Seq, shape: T5Shape):
        self.collator = collator
        self.shape = shape
        self.batches: list[StepWork] = []

    def __call__(self, features: list[dict]) -> dict:
        lengths = [(len(feature["input_ids"]), len(feature["labels"])) for feature in features]
        self.batches.append(
            StepWork(
                len(features),
                sum(training_flops(self.shape, source, target) for source, target in lengths),
                sum(source + target for source, target in lengths),
            )
        )
        return self.collator(features)


def docs_settings(output: Path, batch: int, max_steps: int, cuda: bool) -> dict[str, Any]:
    """The ``Seq2SeqTrainingArguments`` the docs advise (on CUDA: bf16, TF32), with the bench's quiet logging and
    no checkpoints.

    :rtype: dict
    """
    return {
        "output_dir": str(output),
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": EVAL_BATCH,
        "max_steps": max_steps,
        "optim": "adamw_torch_fused",
        "learning_rate": LEARNING_RATE,
        "warmup_steps": WARMUP_SHARE,
        "bf16": cuda,
        "tf32": True if cuda else None,
        "train_sampling_strategy": "group_by_length",
        "dataloader_drop_last": True,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": SEED,
        "logging_strategy": "no",
        "use_cpu": not cuda,
    }


def peer_recipe(
    model: Path,
    data: Path,
    output: Path,
    clock: StepClock,
    max_steps: int,
    device: str,
    batch: int,
    shape: T5Shape,
    callbacks: tuple[TrainerCallback, ...] = (),
    compute_metrics: Callable | None = None,
    trainer_class: Callable[..., Seq2SeqTrainer] = Seq2SeqTrainer,
    **values,
) -> dict:
    """Train the docs' way in this process.

    :param batch: the per-device batch (:func:`peer_batch`).
    :param shape: the model's shape, for each batch's FLOPs.
    :param callbacks: more trainer callbacks (a :class:`bench.timeline.Timeline`).
    :param compute_metrics: the trainer's, for evaluations that generate.
    :param trainer_class: what builds the trainer (the time to accuracy's evaluates under the grammar).
    :param values: more or other ``Seq2SeqTrainingArguments`` (evaluation settings).
    :returns: the clock's record, the work of every step from the first (``step_work``), and the peak memory
        (``peak_memory_bytes``, read as ``memory_measure`` says).
    :rtype: dict
    """
    prepared = datasets.load_from_disk(str(data))
    trained = load_model(str(model))
    cuda = device == "cuda"
    tokenizer = load_tokenizer(str(model))
    collator = RecordingCollator(
        DataCollatorForSeq2Seq(
            tokenizer,
            model=trained,
            label_pad_token_id=LABEL_PAD_TOKEN_ID,
            pad_to_multiple_of=PAD_MULTIPLE if cuda else None,
        ),
        shape,
    )
    args = Seq2SeqTrainingArguments(**(docs_settings(output, batch, max_steps, cuda) | values))
    measured = train_measured(
        cuda,
        trainer_class,
        model=trained,
        args=args,
        processing_class=tokenizer,  # as run_translation.py passes it
        train_dataset=prepared["train"],
        eval_dataset=prepared.get("validation"),
        data_collator=collator,
        compute_metrics=compute_metrics,
        callbacks=[clock, *callbacks],
    )
    return {**clock.record(), "step_work": [list(work) for work in collator.batches], **measured}
