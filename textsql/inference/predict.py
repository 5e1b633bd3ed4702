"""A split's predictions: its questions read, SQL written for each to ``predictions.jsonl``, and scored.

:func:`load_questions` reads the questions of a prepared dataset, a JSON-lines file or a data source;
:func:`predict` has a :class:`~textsql.inference.predictor.Predictor` answer them and writes one line per
question to ``predictions.jsonl`` (optionally also the official WikiSQL prediction format), plus
``metrics.json`` beside it when the questions have gold queries (:mod:`textsql.scoring.evaluate`), which also go
into the model's card and, for a tracked run, to MLflow. :func:`parse_header` and :func:`format_summary` are
``textsql infer``'s reading of a header and its report; :func:`answered_questions` finds again the questions a
predictions file answered, so ``textsql evaluate`` scores it as ``textsql infer`` did.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textsql.arguments import GenerationOptions
from textsql.console import counted
from textsql.constants import METRICS_NAME, PREDICTIONS_NAME, PREPARE_JSON_NAME
from textsql.data.sql import parsed, render_sql
from textsql.data.tables import load_tables, prepared_tables_path
from textsql.data.wikisql import NAMED_SOURCES, load_split
from textsql.errors import DataError
from textsql.inference.predictor import Predictor
from textsql.json_files import read_jsonl, write_json, write_jsonl
from textsql.model_card import record_evaluation
from textsql.scoring.evaluate import evaluate, format_report
from textsql.tracking.mlflow_runs import log_evaluation

logger = logging.getLogger(__name__)


@dataclass
class Questions:
    """The questions of one split in the form inference needs, and their tables when known."""

    items: list[dict]
    tables: dict[str, dict] | None
    prepared_ids: list[list[int]] | None = None


def load_questions(data: str | Path, split: str = "validation", limit: int | None = None) -> Questions:
    """Read the questions to answer from a prepared dataset, a JSON-lines file, or a data source.

    :param data: a ``textsql prepare`` output directory (its tokenized inputs are used as they are);
        a ``.jsonl`` file of records (``question`` and ``header``; ``id``, ``table_id``, ``sql``,
        ``types`` and ``rows`` when known); or a source for :func:`textsql.data.wikisql.load_split`
        (``sample``, ``hub``, a release directory).
    :param split: ``train``, ``validation`` or ``test`` (not used for a ``.jsonl`` file).
    :param limit: only the first ``limit`` questions.
    :rtype: Questions
    """
    path = Path(data).expanduser()
    if (path / PREPARE_JSON_NAME).is_file():
        return _prepared_questions(path, split, limit)
    if path.suffix == ".jsonl":
        records = [
            _checked_record(item, index, path)
            for index, item in enumerate(read_jsonl(path))
            if limit is None or index < limit
        ]
        with_rows = {item["table_id"]: item for item in records if item.get("rows") and item.get("types")}
        return Questions(records, with_rows or None)
    records, tables = load_split(data, split, limit)
    return Questions(records, tables)


def _prepared_questions(path: Path, split: str, limit: int | None) -> Questions:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))[split]
    except KeyError:
        raise DataError(f"{str(path)!r} has no {split!r} split; pass --split train, validation or test") from None
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    items = [
        {
            "id": row["id"],
            "table_id": row["table_id"],
            "question": row["question"],
            "header": row["header"],
            "sql": json.loads(row["sql"]),
        }
        for row in dataset.select_columns(["id", "table_id", "question", "header", "sql"])
    ]
    tables_path = prepared_tables_path(path, split)
    return Questions(items, load_tables(tables_path) if tables_path.is_file() else None, list(dataset["input_ids"]))


def _checked_record(item: dict, index: int, path: Path) -> dict:
    if not isinstance(item.get("question"), str) or not isinstance(item.get("header"), list):
        raise DataError(
            f"{path}: line {index + 1} needs a question and a header (list of column names); for the release's "
            "question files pass their directory as the source (textsql infer --source DIR)"
        )
    return {**item, "id": str(item.get("id", index)), "table_id": item.get("table_id")}


def predict(
    model_dir: str | Path | Predictor | None,
    data: str | Path,
    split: str = "validation",
    out: str | Path = PREDICTIONS_NAME,
    options: GenerationOptions | None = None,
    limit: int | None = None,
    official_out: str | Path | None = None,
    progress: bool = True,
    metrics_out: str | Path | None = None,
) -> dict:
    """Write SQL for every question of a split to ``out``, and its scores to ``metrics.json`` beside it.

    Each line of ``out``: ``id``, ``table_id``, ``question``, ``pred_sql`` (generated text), ``query``
    (parsed structured query, or ``None``), ``error`` (why it did not parse, or ``None``),
    ``gold_sql`` and ``gold_query`` (``None`` when the questions have none).

    Usage::

        >>> summary = predict("runs/demo/model", "runs/demo/data", "validation",
        ...                   out="runs/demo/predictions.jsonl")           # doctest: +SKIP
        >>> summary["metrics"]["lf_accuracy"]                            # doctest: +SKIP

    :param model_dir: a trained model directory, or a loaded :class:`Predictor`.
    :param data: see :func:`load_questions`.
    :param split: which split.
    :param out: predictions file to write (its folder is created).
    :param options: batch size and decoding.
    :param limit: only the first ``limit`` questions.
    :param official_out: also write the official WikiSQL prediction format here.
    :param progress: show a progress bar.
    :param metrics_out: where the metrics go (default: ``metrics.json`` beside ``out``).
    :returns: paths written, counts, timing and the metrics (``None`` without gold queries).
    :rtype: dict
    """
    options = options or GenerationOptions()
    predictor = model_dir if isinstance(model_dir, Predictor) else Predictor.load(model_dir)
    questions = load_questions(data, split, limit)
    if not questions.items:
        raise DataError(
            f"no questions in {str(data)!r} split {split!r}; check the questions given (--data-dir, --source or --questions-file) and --split"
        )
    input_ids = questions.prepared_ids or [
        predictor.encode(item["question"], item["header"], options.max_source_length) for item in questions.items
    ]
    started = time.perf_counter()
    texts = predictor.generate(input_ids, options, progress=progress, items=questions.items, tables=questions.tables)
    seconds = time.perf_counter() - started
    lines = [_prediction_line(item, text) for item, text in zip(questions.items, texts)]
    out = Path(out)
    write_jsonl(out, lines)
    if official_out:
        write_jsonl(official_out, [_official_line(line) for line in lines])
    summary: dict[str, Any] = {
        "predictions": str(out),
        "official": str(official_out) if official_out else None,
        "n": len(lines),
        "parse_errors": sum(line["error"] is not None for line in lines),
        "seconds": round(seconds, 3),
        "questions_per_second": round(len(lines) / seconds, 2) if seconds else None,
        "device": str(predictor.device),
        "constrained": options.constrained,
        "num_beams": options.num_beams,
        "metrics": None,
    }
    if all(item.get("sql") for item in questions.items):
        metrics = evaluate(questions.items, lines, tables=questions.tables)
        metrics["inference"] = {key: value for key, value in summary.items() if key != "metrics"}
        metrics["inference"] |= {"questions": _recorded_source(data), "split": split}
        metrics_file = write_json(metrics_out or out.with_name(METRICS_NAME), metrics)
        record_evaluation(predictor.model_dir, metrics, data, split)
        summary["metrics"] = metrics
        if predictor.model_dir is not None:  # a trained model's run, tracked with --report_to mlflow, gets them too
            log_evaluation(predictor.model_dir.parent, split, metrics, metrics_file)
    logger.info(
        "%d predictions in %.1fs (%s questions/s) -> %s", len(lines), seconds, summary["questions_per_second"], out
    )
    return summary


def _recorded_source(data: str | Path) -> str:
    """The questions' source as ``metrics.json`` records it for :func:`answered_questions`: a path made absolute
    (``textsql evaluate`` may run from elsewhere), a source's name as it is."""
    path = Path(data).expanduser()
    named = str(data) in NAMED_SOURCES and not (path / PREPARE_JSON_NAME).is_file()
    return str(path.resolve()) if path.exists() and not named else str(data)


def answered_questions(predictions: str | Path) -> Questions | None:
    """The questions, gold queries and tables :func:`predict` scored ``predictions`` with, read again from where the
    ``metrics.json`` beside it says they came from (``real_metrics.json`` beside ``real_predictions.jsonl``).

    :param predictions: a predictions file :func:`predict` wrote.
    :returns: None when no metrics file beside it records them (predictions not written by :func:`predict`, or
        moved away from their metrics).
    :rtype: Questions | None
    """
    path = Path(predictions)
    beside = {path.with_name(path.stem.replace("predictions", "metrics") + ".json"), path.with_name(METRICS_NAME)}
    for metrics_file in sorted(beside):
        try:
            record = json.loads(metrics_file.read_text())["inference"]
            source, split, count = record["questions"], record["split"], record["n"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if Path(str(record.get("predictions"))).name == path.name:
            return load_questions(source, split, count)
    return None


def _prediction_line(item: dict, text: str) -> dict:
    gold = item.get("sql")
    return {
        "id": item["id"],
        "table_id": item.get("table_id"),
        "question": item["question"],
        "pred_sql": text,
        **parsed(text, item["header"]),
        "gold_sql": render_sql(gold, item["header"]) if gold else None,
        "gold_query": gold,
    }


def _official_line(line: dict) -> dict:
    return {"query": line["query"]} if line["query"] is not None else {"error": line["error"]}


def parse_header(text: str) -> list[str]:
    """Column names given on the command line: a JSON list, or names separated by commas.

    :param text: ``'["Player", "No."]'`` or ``'Player,No.'``.
    :rtype: list[str]
    """
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(
                f"--header {text!r} is not a JSON list ({error.msg}); write '[\"A\", \"B\"]' or 'A,B'"
            ) from None
    else:
        names = [name.strip() for name in text.split(",")]
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name for name in names):
        raise DataError(f"--header {text!r} holds no column names; write 'A,B' or a JSON list when a name has a comma")
    return names


def format_summary(summary: dict) -> str:
    """A few lines for the terminal about a :func:`predict` run.

    :rtype: str
    """
    text = (
        f"wrote {counted(summary['n'], 'prediction')} to {summary['predictions']} ({summary['parse_errors']} unparsable) "
        f"in {summary['seconds']}s on {summary['device']} ({summary['questions_per_second']} questions/s)"
    )
    if summary["official"]:
        text += f"\nofficial format: {summary['official']}"
    if summary["metrics"]:
        text += "\n" + format_report(summary["metrics"])
    return text
