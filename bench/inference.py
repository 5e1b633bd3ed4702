"""Inference figures.

``infer_speedup_batched``: batched generation (textsql.inference.predictor) against the seed's one question at a time.
Seed arm: ``model.generate(input_ids)`` for each question alone, no attention mask needed or passed.
Our arm: :meth:`textsql.inference.predictor.Predictor.generate`: batches of 64 sorted by length, padded, with their
attention mask, decoding freely as the seed does. Both: the same model (``textsql.model.load_model()``,
seed 42), the same tokenized questions (the prepared sample's validation split), greedy, the same
``max_new_tokens``.

``infer_constrained_over_free``: the same batched generation constrained to each question's WikiSQL
grammar (textsql.decoding.grammar, the default) against free decoding, from one run: questions/s of each and
the share of each arm's outputs that parse as queries over their table.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import datasets
import torch

from bench.timing import alternate, ratio, summary
from textsql.arguments import GenerationOptions
from textsql.data.sql import parsed
from textsql.data.wikisql import load_records
from textsql.inference.predictor import Predictor
from textsql.model import load_model, load_tokenizer

logger = logging.getLogger(__name__)

BATCH_SIZE = 64


@dataclass(frozen=True)
class Sizes:
    """How much work one measurement does."""

    # One full batch; the seed arm's cost grows linearly with both numbers, so they are kept small
    # enough for a shared 2-core machine.
    questions: int = 64
    max_new_tokens: int = 24
    repetitions: int = 3
    warmup_questions: int = 2


def run(data_dir: str, sizes: Sizes = Sizes(), device: str = "cpu") -> dict:
    """Measure both arms alternately and return the figure.

    :param data_dir: a ``textsql prepare`` output.
    :param sizes: questions, generated length, repetitions.
    :param device: where both arms generate.
    :rtype: dict
    """
    questions = datasets.load_from_disk(data_dir)["validation"]
    input_ids = [list(ids) for ids in questions.select(range(min(sizes.questions, len(questions))))["input_ids"]]
    predictor = Predictor(load_model(), load_tokenizer(), input_format="question", device=device)
    options = GenerationOptions(batch_size=BATCH_SIZE, max_new_tokens=sizes.max_new_tokens, constrained=False)
    generated: dict[str, int] = {}

    cpu_rates: dict[str, list[float]] = {"ours": [], "seed": []}

    def timed(name: str, work, batch: list[list[int]]) -> float:
        started, started_cpu = time.perf_counter(), time.process_time()
        work(batch)
        cpu_rates[name].append(len(batch) / (time.process_time() - started_cpu))
        return len(batch) / (time.perf_counter() - started)

    def ours(batch: list[list[int]]) -> None:
        predictor.generate(batch, options)

    def seed(batch: list[list[int]]) -> None:
        generated["seed"] = one_at_a_time(predictor.model, batch, sizes.max_new_tokens)

    logger.info(
        "infer: %d questions, %d new tokens at most, %d rounds", len(input_ids), sizes.max_new_tokens, sizes.repetitions
    )
    for arm in (seed, ours):  # warm-up on a few questions: lazy initialisation, allocator
        arm(input_ids[: sizes.warmup_questions])
    rates = alternate(
        {
            "seed_one_at_a_time": lambda: timed("seed", seed, input_ids),
            "ours_batched_64": lambda: timed("ours", ours, input_ids),
        },
        sizes.repetitions,
        warmup=0,
    )
    return {
        "value": ratio(rates["ours_batched_64"], rates["seed_one_at_a_time"]),
        "unit": "x (examples/s ours / seed)",
        "goal": ">= 8.0",
        "examples_per_s": {name: summary(values) for name, values in rates.items()},
        # Per second of this process's CPU time: less the waiting for a core other jobs held.
        "value_cpu_time": ratio(cpu_rates["ours"], cpu_rates["seed"]),
        "examples_per_cpu_s": {name: summary(values) for name, values in cpu_rates.items()},
        # The untrained model never writes </s>, so every question runs to max_new_tokens in both arms:
        # the same work on each side, and no batch waits on a longer member.
        "generated_tokens_per_question": round(generated["seed"] / len(input_ids), 1),
        "method": (
            f"{len(input_ids)} validation questions of the prepared sample (question-only input), untrained "
            f"textsql.model.load_model() (seed 42), greedy, max_new_tokens {sizes.max_new_tokens}, torch on {device} with "
            f"{torch.get_num_threads()} threads; ours: textsql.inference.predictor.Predictor.generate, batch {BATCH_SIZE}, length-sorted, "
            f"attention mask; seed: model.generate per question; warm-up: each arm on {sizes.warmup_questions} questions; {sizes.repetitions} rounds "
            "alternating the arms; value = ratio of median wall-clock examples/s; value_cpu_time = the same from process CPU time"
        ),
    }


def one_at_a_time(model, input_ids: list[list[int]], max_new_tokens: int) -> int:
    """The seed's inference: ``model.generate`` on each question alone, greedy, no attention mask.

    :returns: the tokens generated in all.
    :rtype: int
    """
    tokens = 0
    with torch.inference_mode():
        for ids in input_ids:
            output = model.generate(
                torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens, do_sample=False
            )
            tokens += output.shape[1] - 1  # less the decoder start token
    return tokens


@dataclass(frozen=True)
class ConstrainedSizes:
    """How much work the constrained-decoding figure does."""

    questions: int = 100
    max_new_tokens: int = 64
    num_beams: int = 1
    repetitions: int = 3
    device: str | None = None


def run_constrained(sizes: ConstrainedSizes = ConstrainedSizes()) -> dict:
    """Constrained against free batched generation, alternately, on the sample's validation questions.

    :param sizes: questions, generated length, beams, repetitions, device (default: CUDA when present).
    :rtype: dict
    """
    records = load_records("sample", "validation", limit=sizes.questions)
    predictor = Predictor(load_model(), load_tokenizer(), device=sizes.device)
    input_ids = [predictor.encode(record["question"], record["header"]) for record in records]
    arms = {
        name: GenerationOptions(
            batch_size=BATCH_SIZE,
            num_beams=sizes.num_beams,
            max_new_tokens=sizes.max_new_tokens,
            constrained=constrained,
        )
        for name, constrained in (("free", False), ("constrained", True))
    }
    outputs: dict[str, list[str]] = {}

    def timed(name: str) -> float:
        started = time.perf_counter()
        outputs[name] = predictor.generate(input_ids, arms[name], items=records)
        if predictor.device.type == "cuda":
            torch.cuda.synchronize()
        return len(input_ids) / (time.perf_counter() - started)

    logger.info(
        "infer constrained: %d questions, %d new tokens at most, %d rounds",
        len(input_ids),
        sizes.max_new_tokens,
        sizes.repetitions,
    )
    rates = alternate({name: lambda name=name: timed(name) for name in arms}, sizes.repetitions, warmup=1)
    parse_rate = {
        name: round(
            sum(parsed(text, record["header"])["query"] is not None for text, record in zip(texts, records))
            / len(records),
            4,
        )
        for name, texts in outputs.items()
    }
    return {
        "value": ratio(rates["constrained"], rates["free"]),
        "unit": "x (questions/s constrained / free)",
        # Constrained decoding may cost at most half the speed of free decoding.
        "goal": ">= 0.5",
        "examples_per_s": {name: summary(values) for name, values in rates.items()},
        "parse_rate": parse_rate,
        # Free decoding of an untrained model never writes </s>; constrained decoding may end a query early.
        "generated_tokens_per_question": {
            name: round(sum(len(ids) for ids in predictor.tokenizer(texts)["input_ids"]) / len(texts), 1)
            for name, texts in outputs.items()
        },
        "method": (
            f"{len(input_ids)} validation questions of the sample (schema input), untrained textsql.model.load_model() "
            f"(seed 42) on {predictor.device}, beams {sizes.num_beams}, max_new_tokens {sizes.max_new_tokens}, "
            f"textsql.inference.predictor.Predictor.generate batch {BATCH_SIZE}; constrained: a grammar per question compiled per batch "
            f"(textsql.decoding.grammar); 1 warm-up round, {sizes.repetitions} rounds alternating the arms; value = ratio of median "
            "questions/s; parse_rate = share of outputs that parse as queries over their table"
        ),
    }
