"""``train_speedup_dynamic_padding``: per-batch padding with length grouping against the seed's fixed padding.

Seed arm: every question and query padded to ``max_length=96`` tokens, the pad tokens left in the
labels (so the loss is also computed, and trained, on padding), random batches.
Our arm: what ``textsql.training.train`` does: unpadded examples from ``textsql prepare``, padded per batch by
``DataCollatorForSeq2Seq(label_pad_token_id=-100, pad_to_multiple_of=8)``, batches grouped by length.
Both arms: the same small T5 (``textsql.model.load_model()``, same seed), the same prepared sample,
the same number of steps, batch size and trainer settings (``Seq2SeqTrainer``, one process, fp32).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from functools import partial

import datasets
from transformers import (
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
    default_data_collator,
)

from bench.timing import alternate, ratio, summary
from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.model import load_model, load_tokenizer

logger = logging.getLogger(__name__)

SEED_MAX_LENGTH = 96
PAD_TO_MULTIPLE_OF = 8  # textsql.training.train's default


@dataclass(frozen=True)
class Sizes:
    """How much work one measurement does."""

    # One epoch over the first 256 train questions (16 steps of 16): length grouping sorts them into
    # batches from the longest to the shortest, so a whole epoch is timed, not its longest part.
    examples: int = 256
    batch_size: int = 16
    repetitions: int = 3
    warmup_steps: int = 2  # a short unmeasured run of each arm first


class StepClock(TrainerCallback):
    """Wall and process CPU time from the first step's start to the last step's end (trainer set-up excluded)."""

    def __init__(self) -> None:
        self.started = self.ended = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.started == (0.0, 0.0):
            self.started = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.ended = (time.perf_counter(), time.process_time())


def run(data_dir: str, sizes: Sizes = Sizes()) -> dict:
    """Measure both arms alternately and return the figure.

    :param data_dir: a ``textsql prepare`` output (the bench prepares the sample in question form).
    :param sizes: examples, batch size, repetitions.
    :rtype: dict
    """
    tokenizer = load_tokenizer()
    prepared = datasets.load_from_disk(data_dir)["train"]
    prepared = prepared.select(range(min(sizes.examples, len(prepared))))
    steps = len(prepared) // sizes.batch_size  # one epoch, last partial batch dropped
    ours = prepared.select_columns(["input_ids", "attention_mask", "labels"])
    seed = prepared.map(partial(seed_padding, tokenizer=tokenizer), batched=True, remove_columns=prepared.column_names)

    cpu_rates: dict[str, list[float]] = {}

    def arm(name: str, dataset: datasets.Dataset, collator, strategy: str, steps: int = steps) -> float:
        wall, cpu = train_rates(dataset, collator, strategy, steps, sizes.batch_size)
        cpu_rates.setdefault(name, []).append(cpu)
        return wall

    logger.info("train: %d steps of %d, %d rounds", steps, sizes.batch_size, sizes.repetitions)
    our_collator = DataCollatorForSeq2Seq(
        tokenizer, label_pad_token_id=LABEL_PAD_TOKEN_ID, pad_to_multiple_of=PAD_TO_MULTIPLE_OF
    )
    arm("warm-up", seed, default_data_collator, "random", sizes.warmup_steps)
    arm("warm-up", ours, our_collator, "group_by_length", sizes.warmup_steps)
    rates = alternate(
        {
            "seed_fixed_96": lambda: arm("seed_fixed_96", seed, default_data_collator, "random"),
            "ours_dynamic_grouped": lambda: arm("ours_dynamic_grouped", ours, our_collator, "group_by_length"),
        },
        sizes.repetitions,
        warmup=0,
    )
    tokens = {
        "seed_fixed_96": 2 * SEED_MAX_LENGTH,
        "ours_mean_unpadded": round(
            sum(len(i) + len(l) for i, l in zip(ours["input_ids"], ours["labels"])) / len(ours), 1
        ),
    }
    return {
        "value": ratio(rates["ours_dynamic_grouped"], rates["seed_fixed_96"]),
        "unit": "x (samples/s ours / seed)",
        "goal": ">= 2.0",
        "samples_per_s": {name: summary(values) for name, values in rates.items()},
        # The same runs per second of this process's CPU time: what the arms cost, less the time spent
        # waiting for a core that other developers' jobs held (the wall-clock figure's main noise here).
        "value_cpu_time": ratio(cpu_rates["ours_dynamic_grouped"], cpu_rates["seed_fixed_96"]),
        "samples_per_cpu_s": {name: summary(cpu_rates[name]) for name in rates},
        "tokens_per_example_source_plus_target": tokens,
        "method": (
            f"Seq2SeqTrainer, one process, fp32, no DeepSpeed in either arm; model textsql.model.load_model() (seed 42); "
            f"{len(prepared)} prepared sample train examples (question-only input, the seed's form); batch {sizes.batch_size}, "
            f"{steps} steps (one epoch) per run timed from the first step's start to the last step's end; "
            f"warm-up: a {sizes.warmup_steps}-step run of each arm; then {sizes.repetitions} rounds alternating the arms; value = ratio of "
            "median wall-clock samples/s; value_cpu_time = the same from process CPU time"
        ),
    }


def train_rates(dataset: datasets.Dataset, collator, strategy: str, steps: int, batch_size: int) -> tuple[float, float]:
    """Train the small T5 for ``steps`` steps of ``batch_size`` with a plain Seq2SeqTrainer, one process, fp32.

    :param strategy: the trainer's ``train_sampling_strategy`` (``random`` or ``group_by_length``).
    :returns: samples per wall-clock second and per second of this process's CPU time, from the first step's
        start to the last step's end.
    :rtype: tuple[float, float]
    """
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as output:
        args = Seq2SeqTrainingArguments(
            output_dir=output,
            per_device_train_batch_size=batch_size,
            max_steps=steps,
            learning_rate=1e-3,
            dataloader_drop_last=True,
            train_sampling_strategy=strategy,
            report_to=[],
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            seed=42,
        )
        model = load_model()
        model.accepts_loss_kwargs = False  # as textsql.training.train sets it
        trainer = Seq2SeqTrainer(
            model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[clock]
        )
        trainer.train()
    wall, cpu = (end - start for end, start in zip(clock.ended, clock.started))
    return steps * batch_size / wall, steps * batch_size / cpu


def seed_padding(batch: dict, tokenizer) -> dict:
    """The seed notebook's preprocessing: pad everything to 96 and keep pad ids in the labels."""
    sources = tokenizer(batch["source_text"], padding="max_length", max_length=SEED_MAX_LENGTH, truncation=True)
    targets = tokenizer(text_target=batch["target"], padding="max_length", max_length=SEED_MAX_LENGTH, truncation=True)
    return {
        "input_ids": sources["input_ids"],
        "attention_mask": sources["attention_mask"],
        "labels": targets["input_ids"],
    }
