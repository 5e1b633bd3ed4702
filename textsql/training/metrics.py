"""The scores a training run's evaluations log: WikiSQL's own metrics of the generated queries.

Each evaluation during training (and the final one) generates a query per validation question; besides
the exact match of the text, :func:`wikisql_metrics` reads every generated query back over its
question's table and scores it as ``textsql evaluate`` does: logical-form accuracy, the parse rate
(queries over their own table), and execution accuracy where the tables carry rows. They reach
TensorBoard as ``eval/lf_accuracy``, ``eval/parse_rate`` and ``eval/ex_accuracy`` beside the loss.

The evaluation's sampler may reorder the questions (``group_by_length``), so each prediction is matched
to its question by its input ids, which the trainer hands over with ``include_for_metrics=["inputs"]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase
from transformers.trainer_utils import EvalPrediction

from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.data.sql import parsed
from textsql.data.tables import load_tables, prepared_tables_path
from textsql.scoring.evaluate import evaluate

logger = logging.getLogger(__name__)

EVAL_SPLIT = "validation"
QUESTION_COLUMNS = ["id", "table_id", "header", "sql", "input_ids"]


def decode(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray | Sequence[Any]) -> list[str]:
    """Texts of token ids as the trainer gathers them (``-100`` where a row was padded).

    :rtype: list[str]
    """
    ids = [np.where(np.asarray(row) == LABEL_PAD_TOKEN_ID, tokenizer.pad_token_id, np.asarray(row)) for row in ids]
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def eval_questions(data_dir: str | Path, limit: int | None) -> tuple[list[dict], dict[str, dict] | None]:
    """The first ``limit`` validation questions of a prepared dataset (what training evaluates on), and their tables.

    :param data_dir: a ``textsql prepare`` output directory.
    :param limit: ``--max_eval_samples``.
    :returns: questions with ``id``, ``table_id``, ``header``, ``sql`` and ``input_ids``; tables by id, or
        ``None`` when the dataset has none for the split.
    :rtype: tuple[list[dict], dict | None]
    """
    import datasets

    loaded = datasets.load_from_disk(str(data_dir))
    if EVAL_SPLIT not in loaded or not {*QUESTION_COLUMNS} <= set(loaded[EVAL_SPLIT].column_names):
        return [], None
    split = loaded[EVAL_SPLIT]
    split = split.select(range(min(limit, len(split)))) if limit is not None else split
    questions = [{**row, "sql": json.loads(row["sql"])} for row in split.select_columns(QUESTION_COLUMNS)]
    tables_path = prepared_tables_path(data_dir, EVAL_SPLIT)
    return questions, load_tables(tables_path) if tables_path.is_file() else None


def wikisql_metrics(
    tokenizer: PreTrainedTokenizerBase, questions: list[dict], tables: dict[str, dict] | None = None
) -> Callable[[EvalPrediction], dict[str, float]]:
    """A ``compute_metrics`` for generated queries: exact match, and WikiSQL's scores where the questions are known.

    Usage::

        >>> questions, tables = eval_questions("runs/demo/data", 64)               # doctest: +SKIP
        >>> trainer = Seq2SeqTrainer(..., compute_metrics=wikisql_metrics(tokenizer, questions, tables))  # doctest: +SKIP

    :param tokenizer: the model's tokenizer.
    :param questions: what :func:`eval_questions` returned (empty: exact match only).
    :param tables: tables by id; execution accuracy is scored only when some carry rows.
    :returns: a function of the trainer's ``EvalPrediction`` returning ``exact_match``, ``lf_accuracy``,
        ``parse_rate`` and, with rows, ``ex_accuracy``.
    :rtype: typing.Callable
    """
    by_source = dict(zip(decode(tokenizer, [item["input_ids"] for item in questions]), questions))

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        predicted = decode(tokenizer, prediction.predictions)
        scores = {
            "exact_match": float(np.mean([p == e for p, e in zip(predicted, decode(tokenizer, prediction.label_ids))]))
        }
        if prediction.inputs is None or not by_source:
            return scores
        matched = [
            (by_source.get(source), text) for source, text in zip(decode(tokenizer, prediction.inputs), predicted)
        ]
        gold = [{**item, "id": str(index)} for index, (item, _) in enumerate(matched) if item is not None]
        lines = [
            {"id": str(index), **parsed(text, item["header"])}
            for index, (item, text) in enumerate(matched)
            if item is not None
        ]
        if len(gold) < len(matched):
            logger.warning(
                "%d of %d evaluated questions not found in the validation split; scored without them",
                len(matched) - len(gold),
                len(matched),
            )
        if not gold:
            return scores
        report = evaluate(gold, lines, tables or {})
        scores.update(lf_accuracy=report["lf_accuracy"], parse_rate=report["parse_rate"])
        if report["ex_accuracy"] is not None:
            scores["ex_accuracy"] = report["ex_accuracy"]
        return scores

    return compute_metrics
