"""WikiSQL-shaped training data at full scale, from the shipped sample.

The sample holds 1,000 training questions; WikiSQL's training split holds 56,355. Drawing 56,355 of the
sample's prepared examples with replacement (seeded) keeps the sample's joint distribution of source and
target lengths, which is what sets batch shapes, padding and FLOPs, while an epoch has as many batches as
a real WikiSQL epoch. The texts repeat, so the figures are about speed, not about what the model learns.
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import numpy as np

logger = logging.getLogger(__name__)

WIKISQL_TRAIN_QUESTIONS = 56_355
MODEL_COLUMNS = ["input_ids", "attention_mask", "labels"]


def full_scale(
    data_dir: str, target: Path, questions: int = WIKISQL_TRAIN_QUESTIONS, validation: bool = False, seed: int = 42
) -> Path:
    """Save ``questions`` training examples resampled from ``data_dir``'s train split (the same ones for a
    given seed), with its validation split when asked (runs without one skip the final evaluation).

    :param data_dir: a ``textsql prepare`` output.
    :param target: where the dataset is saved (reused when it exists).
    :rtype: pathlib.Path
    """
    if target.exists():
        return target
    prepared = datasets.load_from_disk(data_dir)
    train = prepared["train"].select_columns(MODEL_COLUMNS)
    picks = np.random.default_rng(seed).integers(0, len(train), questions)
    resampled = datasets.DatasetDict({"train": train.select(picks).flatten_indices()})
    if validation:
        resampled["validation"] = prepared["validation"].select_columns(MODEL_COLUMNS)
    resampled.save_to_disk(str(target))
    logger.info("%d training questions resampled from %d into %s", questions, len(train), target)
    return target


def prepare_data(work: Path, input_format: str = "question") -> str:
    """The shipped sample prepared in ``input_format``: the seed's question-only form (the padding and inference
    figures' data), or ``schema`` (what training uses by default: the GPU figures' and op counts' data).

    :rtype: str
    """
    from textsql.data.prepare import prepare

    out = work / ("data" if input_format == "question" else f"data-{input_format}")
    if not out.exists():
        prepare(data_dir=str(out), input_format=input_format)
    return str(out)
