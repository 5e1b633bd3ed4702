"""``prepare_examples_per_s``: tokenizing with batched ``datasets.map`` (as ``textsql prepare`` does) against a per-example loop.

Two inputs: the shipped sample (all three splits, schema input text and SQL target, both tokenized)
and the full WikiSQL dev split from ``../shared/data/wikisql/original/dev.jsonl``. That file has no
table headers here (the release's ``dev.tables.jsonl`` is not available offline), so its questions are
tokenized question-only (``translate to SQL: ...``) and without targets (a target needs the header).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import datasets

from bench.timing import alternate, ratio, summary
from textsql.constants import PROJECT_DIR, SAMPLE_SOURCE, SPLITS
from textsql.data.wikisql import load_records, source_text, target_text
from textsql.json_files import read_jsonl
from textsql.model import load_tokenizer

logger = logging.getLogger(__name__)

MAP_BATCH = 1000  # datasets.map's default batch size
DEV_QUESTIONS = PROJECT_DIR.parent / "shared" / "data" / "wikisql" / "original" / "dev.jsonl"


@dataclass(frozen=True)
class Sizes:
    """Repetitions, and how many dev questions (None: all)."""

    repetitions: int = 5
    warmup: int = 1
    dev_questions: int | None = None


def run(sizes: Sizes = Sizes(), dev_file: Path = DEV_QUESTIONS) -> dict:
    """Measure both arms on the sample and, when present, the dev questions.

    :rtype: dict
    """
    tokenizer = load_tokenizer()
    datasets.disable_progress_bars()
    records = [record for split in SPLITS for record in load_records(SAMPLE_SOURCE, split)]
    inputs = {
        "sample": {
            "source_text": [source_text(r["question"], r["header"]) for r in records],
            "target": [target_text(r) for r in records],
        },
    }
    if dev_file.is_file():
        questions = [line["question"] for line in read_jsonl(dev_file)]
        inputs["dev_questions"] = {
            "source_text": [source_text(q, [], "question") for q in questions[: sizes.dev_questions]]
        }

    figure: dict = {"unit": "examples/s", "goal": None}
    for name, columns in inputs.items():
        rates = alternate(
            {
                "batched_map": lambda c=columns: batched_map(tokenizer, c),
                "per_example_loop": lambda c=columns: per_example(tokenizer, c),
                "batched_tokenizer_call_only": lambda c=columns: batched_call(tokenizer, c),
            },
            sizes.repetitions,
            sizes.warmup,
        )
        figure[name] = {
            "examples": len(columns["source_text"]),
            "tokenized": "input and target (schema input)"
            if "target" in columns
            else "question-only input, no target (no headers available)",
            **{arm: summary(values, 1) for arm, values in rates.items()},
            "speedup": ratio(rates["batched_map"], rates["per_example_loop"]),
        }
    figure["value"] = figure["sample"]["batched_map"]["median"]
    figure["method"] = (
        "fast T5 tokenizer (textsql.model.load_tokenizer); batched_map: datasets.Dataset.from_dict + map(batched=True, "
        "batches of 1000) calling the tokenizer on the batch, as textsql prepare does; per_example_loop: one tokenizer call "
        f"per text; batched_tokenizer_call_only: the tokenizer on lists of 1000 texts without datasets; sample = all {len(records)} questions of the shipped sample; dev_questions = WikiSQL dev questions "
        f"from {DEV_QUESTIONS.name}; {sizes.warmup} warm-up round, {sizes.repetitions} rounds alternating the arms; medians"
    )
    return figure


def batched_map(tokenizer, columns: dict[str, list[str]]) -> float:
    """``datasets.map`` in batches calling the tokenizer on each, as ``textsql prepare`` does.

    :returns: examples/s.
    :rtype: float
    """
    started = time.perf_counter()

    def tokenize(batch: dict) -> dict:
        encoded = {"input_ids": tokenizer(batch["source_text"])["input_ids"]}
        if "target" in batch:
            encoded["labels"] = tokenizer(text_target=batch["target"])["input_ids"]
        return encoded

    datasets.Dataset.from_dict(columns).map(tokenize, batched=True, batch_size=MAP_BATCH)
    return len(columns["source_text"]) / (time.perf_counter() - started)


def batched_call(tokenizer, columns: dict[str, list[str]]) -> float:
    """The tokenizer alone on batches of 1000, no datasets: separates the tokenizer's gain from map's overhead.

    :returns: examples/s.
    :rtype: float
    """
    started = time.perf_counter()
    for start in range(0, len(columns["source_text"]), MAP_BATCH):
        tokenizer(columns["source_text"][start : start + MAP_BATCH])
        if "target" in columns:
            tokenizer(text_target=columns["target"][start : start + MAP_BATCH])
    return len(columns["source_text"]) / (time.perf_counter() - started)


def per_example(tokenizer, columns: dict[str, list[str]]) -> float:
    """One tokenizer call per text.

    :returns: examples/s.
    :rtype: float
    """
    started = time.perf_counter()
    targets = columns.get("target", [None] * len(columns["source_text"]))
    for source, target in zip(columns["source_text"], targets):
        tokenizer(source)
        if target is not None:
            tokenizer(text_target=target)
    return len(columns["source_text"]) / (time.perf_counter() - started)
