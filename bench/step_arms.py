"""What the figures that compare arms on the training steps of one T5 shape share (:mod:`bench.norms`,
:mod:`bench.sliced_loss`): the batch, the precision a step runs in, each arm's step times, and the command that
measures t5-small's and t5-base's shapes.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from bench.machine import figure_arguments, write_figure
from bench.profiles import T5_BASE_CONFIG, T5_SMALL_CONFIG
from bench.steps import clock
from bench.timing import alternate
from textsql.constants import DEFAULT_MODEL_DIR, LABEL_PAD_TOKEN_ID

# Token ids drawn from 5 up to this: T5's vocabulary without its special tokens, and below its size.
VOCABULARY = 32000


def random_batch(
    questions: int, source_tokens: int, target_tokens: int, device: str, padded_targets: int = 0
) -> dict[str, torch.Tensor]:
    """``questions`` random sources of ``source_tokens`` and targets of ``target_tokens``, the last
    ``padded_targets`` of each target padded, on ``device``; the same every call.

    :rtype: dict[str, torch.Tensor]
    """
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, VOCABULARY, (questions, source_tokens), generator=generator)
    labels = torch.randint(5, VOCABULARY, (questions, target_tokens), generator=generator)
    labels[:, target_tokens - padded_targets :] = LABEL_PAD_TOKEN_ID
    return {"input_ids": input_ids.to(device), "labels": labels.to(device)}


def training_precision(device: str) -> AbstractContextManager[Any]:
    """The precision the defaults train in on ``device``: bf16 autocast on CUDA, fp32 on a CPU.

    :rtype: contextlib.AbstractContextManager
    """
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def step_times(
    step: Callable[[str], None], arms: Iterable[str], questions: int, repetitions: int, warmup: int
) -> dict[str, dict]:
    """Each arm's ``median_step_ms`` and ``step_ms_range`` (its fastest and slowest), ``step(arm)`` run alternated
    (:func:`bench.timing.alternate`) over ``repetitions`` rounds after ``warmup``.

    :rtype: dict[str, dict]
    """

    def rate(name: str) -> float:
        began = clock()
        step(name)
        return questions / (clock() - began)

    rates = alternate({name: lambda name=name: rate(name) for name in arms}, repetitions, warmup)
    return {
        name: {
            "median_step_ms": round(1000 * questions / statistics.median(measured), 2),
            "step_ms_range": [round(1000 * questions / rate, 2) for rate in (max(measured), min(measured))],
        }
        for name, measured in rates.items()
    }


def shapes_main(
    argv: list[str] | None,
    prog: str,
    doc: str,
    result: Path,
    measure: Callable[[Any, str, list[Path]], dict],
    sizes: tuple[Any, Any, Any],
) -> int:
    """The command of such a figure: ``measure(sizes, device, models)`` written with the machine to ``--out``; the
    models t5-small's and t5-base's shapes, or the embedded small T5 with ``--smoke``. ``sizes``: the smoke run's,
    a CPU's and a GPU's.

    :rtype: int
    """
    args = figure_arguments(argv, prog, doc, result)
    smoke, cpu, gpu = sizes
    models = [DEFAULT_MODEL_DIR] if args.smoke else [T5_SMALL_CONFIG.parent, T5_BASE_CONFIG.parent]
    chosen = smoke if args.smoke else cpu if args.device == "cpu" else gpu
    write_figure(args.out, measure(chosen, args.device, models))
    return 0
