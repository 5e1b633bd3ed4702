"""Inference: a T5 model writes WikiSQL SQL for questions, batched, and the text is read back.

:class:`Predictor` holds a model and its tokenizer on the best device (CUDA when present). It
generates in batches sorted by input length (longest first, so little is padding and an
out-of-memory shows in the first batch), with attention masks, greedy unless ``num_beams > 1``,
constrained by default to the WikiSQL grammar of each question's table (:mod:`textsql.decoding.grammar`) and,
with beams and tables that carry rows, guided by execution (:mod:`textsql.inference.guidance`), and returns
results in the input order. :func:`predict` runs it over a split and writes one line
per question to ``predictions.jsonl`` (optionally also the official WikiSQL prediction format), plus
``metrics.json`` beside it when the questions have gold queries. :func:`ask` answers one question
written by a user about a table header.

The model's input text is :func:`textsql.data.wikisql.source_text`, the function ``textsql prepare`` uses;
predictions are read back with :func:`textsql.data.sql.parse_sql`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm
from transformers import LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from textsql.arguments import GenerationOptions
from textsql.constants import (
    DEFAULT_MAX_SOURCE_LENGTH,
    INPUT_FORMATS,
    METRICS_NAME,
    PREDICTIONS_NAME,
    PREPARE_JSON_NAME,
    UNCASED_FORMAT,
)
from textsql.data.sql import parsed, render_sql
from textsql.data.wikisql import cased_sql, load_split, recorded_input_format, source_text
from textsql.decoding.processor import grammar_processor, processor_for_inputs
from textsql.errors import DataError, ModelError
from textsql.files import load_tables, prepared_tables_path, read_jsonl, write_json, write_jsonl
from textsql.inference.guidance import ExecutionGuide
from textsql.model import has_weights, load_model, load_tokenizer, resolve_model
from textsql.model_card import record_evaluation
from textsql.scoring.evaluate import evaluate, format_report
from textsql.tracking.mlflow_runs import log_evaluation

logger = logging.getLogger(__name__)


class Predictor:
    """A model, its tokenizer and input format, ready to write SQL.

    Usage::

        >>> predictor = Predictor.load("runs/demo/model")           # doctest: +SKIP
        >>> predictor.ask("How many schools did player number 3 play at?",
        ...               ["Player", "No.", "Nationality", "Position", "Years in Toronto", "School/Club Team"])  # doctest: +SKIP
        {'sql': 'SELECT COUNT School/Club Team FROM table WHERE No. = 3', 'query': {...}, 'error': None}
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        input_format: str = INPUT_FORMATS[0],
        device: str | torch.device | None = None,
        model_dir: Path | None = None,
    ):
        if input_format not in INPUT_FORMATS:
            raise DataError(f"unknown input format {input_format!r}; pass --input-format {' or '.join(INPUT_FORMATS)}")
        self.device = _device(device)
        # transformers types .to through a decorator that mypy reads as taking the model again.
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self.input_format = input_format
        # Where the model was loaded from: evaluation scores go into its model card there.
        self.model_dir = model_dir

    @property
    def uncased(self) -> bool:
        """Whether the model writes its queries in lower case (the ``uncased`` input format)."""
        return self.input_format == UNCASED_FORMAT

    @classmethod
    def load(
        cls, model_dir: str | Path | None = None, input_format: str | None = None, device: str | None = None
    ) -> Predictor:
        """Load a trained model directory (weights, config, tokenizer).

        :param model_dir: ``from_pretrained`` directory or hub id; ``None`` is the untrained embedded T5.
        :param input_format: ``schema``, ``question`` or ``uncased``; by default the one recorded in the model
            directory's ``prepare.json``, else ``schema``.
        :param device: ``cuda``, ``cpu``, ...; by default CUDA when present.
        :rtype: Predictor
        """
        reference = resolve_model(model_dir)
        if Path(reference).is_dir() and not has_weights(reference):
            logger.warning("%s holds no weights: predictions come from an untrained model", reference)
        return cls(
            load_model(reference),
            load_tokenizer(reference),
            input_format or recorded_input_format(reference),
            device,
            Path(reference) if Path(reference).is_dir() else None,
        )

    def generate(
        self,
        input_ids: Sequence[list[int]],
        options: GenerationOptions | None = None,
        progress: bool = False,
        items: Sequence[dict] | None = None,
        tables: dict[str, dict] | None = None,
    ) -> list[str]:
        """SQL text for each tokenized input, in the input order.

        :param input_ids: token ids per question (unpadded, ending in ``</s>``).
        :param options: batch size and decoding; defaults of :class:`GenerationOptions`.
        :param progress: show a progress bar.
        :param items: per input, its ``question`` and ``header`` (and ``table_id``), which constrained
            decoding follows; by default they are read back from the input text.
        :param tables: ``{table_id: table}``; with rows and beams, decoding is execution-guided.
        :rtype: list[str]
        """
        options = options or GenerationOptions()
        order = sorted(range(len(input_ids)), key=lambda index: -len(input_ids[index]))
        texts: list[str] = [""] * len(input_ids)
        guided = bool(items and tables and options.execution_guided and options.num_beams > 1)
        with (
            ExecutionGuide(tables if guided and tables else {}) as guide,
            tqdm(total=len(order), desc="Generating", unit="q", disable=not progress, file=_progress_stream()) as bar,
            torch.inference_mode(),
        ):
            for start in range(0, len(order), options.batch_size):
                chunk = order[start : start + options.batch_size]
                batch = self.tokenizer.pad(
                    [{"input_ids": input_ids[index]} for index in chunk], return_tensors="pt"
                ).to(self.device)
                returned = options.num_beams if guided else 1
                output = self.model.generate(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    do_sample=False,
                    num_beams=options.num_beams,
                    max_new_tokens=options.max_new_tokens,
                    num_return_sequences=returned,
                    logits_processor=self._constraint(
                        batch["input_ids"], [items[index] for index in chunk] if items else None, options
                    ),
                )
                decoded = [text.strip() for text in self.tokenizer.batch_decode(output, skip_special_tokens=True)]
                for position, index in enumerate(chunk):
                    beams = decoded[position * returned : (position + 1) * returned]
                    texts[index] = (
                        guide.choose(beams, items[index]["header"], items[index].get("table_id"))
                        if guided and items
                        else beams[0]
                    )
                    if self.uncased and items:
                        texts[index] = cased_sql(texts[index], items[index]["question"], items[index]["header"])
                bar.update(len(chunk))
        return texts

    def _constraint(
        self, input_ids: torch.Tensor, items: list[dict] | None, options: GenerationOptions
    ) -> LogitsProcessorList | None:
        """The grammar of each question's table for one batch, or ``None`` when decoding is free."""
        if not options.constrained:
            return None
        if items is None:
            return LogitsProcessorList(
                [processor_for_inputs(self.tokenizer, input_ids, options.max_new_tokens, self.uncased)]
            )
        processor = grammar_processor(
            self.tokenizer,
            [item["question"] for item in items],
            [item["header"] for item in items],
            options.max_new_tokens,
            self.uncased,
        )
        return LogitsProcessorList([processor])

    def encode(self, question: str, header: list[str], max_source_length: int = DEFAULT_MAX_SOURCE_LENGTH) -> list[int]:
        """Token ids of the model input for one question, built as ``textsql prepare`` builds them.

        :rtype: list[int]
        """
        return self.tokenizer(
            source_text(question, header, self.input_format), truncation=True, max_length=max_source_length
        )["input_ids"]

    def ask(self, question: str, header: list[str], options: GenerationOptions | None = None) -> dict:
        """Answer one question about a table with this header.

        :param question: English question.
        :param header: the table's column names, in order.
        :param options: decoding options (beams, max new tokens).
        :returns: ``{"sql": text, "query": {sel, agg, conds} or None, "error": None or why it did not parse}``.
        :rtype: dict
        """
        options = options or GenerationOptions()
        if not question.strip():
            raise DataError("the question is empty; pass --question 'How many ...?'")
        if not header:
            raise DataError("no table header; pass --header 'Column A,Column B,...'")
        text = self.generate(
            [self.encode(question, header, options.max_source_length)],
            options,
            items=[{"question": question, "header": header}],
        )[0]
        return {"sql": text, **parsed(text, header)}


def _progress_stream() -> TextIO:
    """Where the progress bar goes: stdout in a notebook kernel, where its carriage returns keep it one updating
    line (stderr there is a red block holding every update, and tqdm's widget needs ipywidgets); else stderr."""
    return sys.stdout if "ipykernel" in sys.modules else sys.stderr


def _device(name: str | torch.device | None) -> torch.device:
    """The device to generate on: the one named, else CUDA when present, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelError(f"unknown device {str(name)!r}; pass --device cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {str(name)!r} asked for but this machine has no CUDA GPU; pass --device cpu")
    return device


def ask(model: str | Path | Predictor | None, question: str, header: list[str], **options: Any) -> dict:
    """Answer one question about a table header (loads the model when given a directory).

    Usage::

        >>> ask("runs/demo/model", "Who is number 3?", ["Player", "No."])   # doctest: +SKIP
        {'sql': 'SELECT Player FROM table WHERE No. = 3', 'query': {'sel': 0, 'agg': 0, 'conds': [[1, 0, '3']]}, 'error': None}

    :param model: a :class:`Predictor` or a model directory / hub id.
    :param question: the question.
    :param header: the table's column names.
    :param options: :class:`GenerationOptions` fields (``num_beams``, ``max_new_tokens``, ``constrained``).
    :rtype: dict
    """
    predictor = model if isinstance(model, Predictor) else Predictor.load(model)
    return predictor.ask(question, header, GenerationOptions(**options))


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
            "question files pass --data the directory that also holds their .tables.jsonl"
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
        raise DataError(f"no questions in {str(data)!r} split {split!r}; check --data and --split")
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
        metrics_file = write_json(metrics_out or out.with_name(METRICS_NAME), metrics)
        record_evaluation(predictor.model_dir, metrics, data, split)
        summary["metrics"] = metrics
        if isinstance(model_dir, str | Path):  # a trained model's run, tracked with --report_to mlflow, gets them too
            log_evaluation(Path(model_dir).parent, split, metrics, metrics_file)
    logger.info(
        "%d predictions in %.1fs (%s questions/s) -> %s", len(lines), seconds, summary["questions_per_second"], out
    )
    return summary


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
        f"wrote {summary['n']} predictions to {summary['predictions']} ({summary['parse_errors']} unparsable) "
        f"in {summary['seconds']}s on {summary['device']} ({summary['questions_per_second']} questions/s)"
    )
    if summary["official"]:
        text += f"\nofficial format: {summary['official']}"
    if summary["metrics"]:
        text += "\n" + format_report(summary["metrics"])
    return text
