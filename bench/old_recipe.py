"""The old notebook's training recipe, the baseline of the GPU figures: a plain ``Seq2SeqTrainer`` in this process,
every input and query padded to 96, fp32 and eager, batch 32, plain AdamW, the full-vocabulary loss.

Pad positions of the labels are -100, so its loss counts real tokens only, as ours does. Its MFU counts what it
runs (:func:`mean_sample_flops`): each trained sample at its length cut to 96, the padding left out.
"""

from __future__ import annotations

import logging
import resource
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback, default_data_collator

from bench.flops import T5Shape, training_flops
from bench.steps import StepClock, phase_markers
from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.model import load_model

logger = logging.getLogger(__name__)

OLD_BATCH = 32
OLD_MAX_LENGTH = 96
EVAL_BATCH = 32  # both arms evaluate in batches of this size, so their eval losses average alike
SEED = 42  # Seq2SeqTrainingArguments' default seed, which the token sampler is seeded with
# T5ForConditionalGeneration's own loss: the softmax over all 32,128 tokens (textsql.training.loss).
LOSS_VOCABULARY = "full"


def label(batch: int = OLD_BATCH) -> str:
    """What the arm is, for tables and JSON.

    :rtype: str
    """
    return (
        f"old recipe: plain Seq2SeqTrainer in the bench process, eager (no torch.compile), fp32, batch {batch} "
        f"padded to {OLD_MAX_LENGTH}, adamw_torch at 1e-3, {LOSS_VOCABULARY}-vocabulary loss"
    )


def pad_to_old_length(batch: dict, pad_id: int) -> dict:
    """The old recipe's inputs: ids cut or padded to 96; label pad positions -100 (never in the loss)."""

    def fixed(rows: list[list[int]], fill: int) -> list[list[int]]:
        return [row[:OLD_MAX_LENGTH] + [fill] * (OLD_MAX_LENGTH - len(row[:OLD_MAX_LENGTH])) for row in rows]

    return {
        "input_ids": fixed(batch["input_ids"], pad_id),
        "attention_mask": fixed(batch["attention_mask"], 0),
        "labels": fixed(batch["labels"], LABEL_PAD_TOKEN_ID),
    }


def trained_examples(data: Path, max_steps: int, batch: int) -> datasets.Dataset:
    """The training examples a run of ``max_steps`` steps draws from: the first ``max_steps x batch``.

    The resampled examples are already in random order: the first max_steps batches' worth of them is a fair
    draw, and padding only those keeps a short run from padding all 56,355.

    :rtype: datasets.Dataset
    """
    train = datasets.load_from_disk(str(data))["train"]
    return train.select(range(min(len(train), max_steps * batch)))


def mean_sample_flops(shape: T5Shape, examples: datasets.Dataset) -> float:
    """Mean real-token training FLOPs of the examples at the lengths the old recipe keeps (cut to 96).

    :rtype: float
    """
    return statistics.fmean(
        training_flops(shape, min(len(source), OLD_MAX_LENGTH), min(len(target), OLD_MAX_LENGTH))
        for source, target in zip(examples["input_ids"], examples["labels"])
    )


def mean_sample_tokens(examples: datasets.Dataset) -> float:
    """Mean real tokens (input and labels) of the examples at the lengths the old recipe keeps (cut to 96).

    :rtype: float
    """
    return statistics.fmean(
        min(len(source), OLD_MAX_LENGTH) + min(len(target), OLD_MAX_LENGTH)
        for source, target in zip(examples["input_ids"], examples["labels"])
    )


def old_recipe(
    model: Path,
    data: Path,
    output: Path,
    clock: StepClock,
    max_steps: int,
    device: str,
    batch: int = OLD_BATCH,
    eval_questions: int | None = None,
    callbacks: tuple[TrainerCallback, ...] = (),
    **values,
) -> dict:
    """Train the old notebook's way (pad 96, fp32, batch 32, plain AdamW, plain trainer) in this process.

    :param eval_questions: evaluate on the first N validation questions (all when ``None``).
    :param callbacks: more trainer callbacks (a :class:`bench.timeline.Timeline`).
    :param values: more ``Seq2SeqTrainingArguments`` (evaluation settings).
    :returns: the clock's record, with the peak memory of the run (``peak_memory_bytes``: torch's high-water mark
        of allocated CUDA memory; on a CPU this process's peak RSS) and how it was read (``memory_measure``).
    :rtype: dict
    """
    prepared = datasets.load_from_disk(str(data))
    prepared["train"] = trained_examples(data, max_steps, batch)
    if "validation" in prepared and eval_questions is not None:
        prepared["validation"] = prepared["validation"].select(range(min(len(prepared["validation"]), eval_questions)))
    trained = load_model(str(model))
    padded = prepared.map(
        pad_to_old_length, batched=True, fn_kwargs={"pad_id": trained.config.pad_token_id}, desc="pad to 96"
    )
    args = Seq2SeqTrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=EVAL_BATCH,
        max_steps=max_steps,
        optim="adamw_torch",
        learning_rate=1e-3,
        dataloader_drop_last=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=SEED,
        logging_strategy="no",
        use_cpu=device == "cpu",
        **values,
    )
    trained.accepts_loss_kwargs = False
    measured = train_measured(
        device == "cuda",
        model=trained,
        args=args,
        train_dataset=padded["train"],
        eval_dataset=padded.get("validation"),
        data_collator=default_data_collator,
        callbacks=[clock, *callbacks],
    )
    # Read after training: the clock sets the profiled step's op counts only when that step ends.
    return {**clock.record(), **measured}


def train_measured(cuda: bool, trainer_class: Callable[..., Seq2SeqTrainer] = Seq2SeqTrainer, **trainer: Any) -> dict:
    """Train a ``Seq2SeqTrainer`` (or ``trainer_class``) built from ``trainer`` in this process, its phases marked
    for the profiler, and say the peak memory it took: torch's high-water mark on CUDA, else this process's peak RSS.

    :returns: ``{"peak_memory_bytes", "memory_measure"}``.
    :rtype: dict
    """
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with phase_markers():
        trainer_class(**trainer).train()
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "peak_memory_bytes": peak,
        "memory_measure": "cuda_max_memory_allocated" if cuda else "peak_rss (the bench process)",
    }
