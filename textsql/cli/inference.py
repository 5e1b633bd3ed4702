"""The inference commands: ``infer`` writes SQL for a split's questions or answers one, ``evaluate`` scores
predictions with WikiSQL's logical-form and execution accuracy (notebook 03)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from textsql.arguments import GenerationOptions
from textsql.cli.help import Command
from textsql.cli.options import field_option, renamed_option
from textsql.constants import INPUT_FORMATS, MODEL_SUBDIR, PREDICTIONS_NAME, PREPARE_JSON_NAME, SAMPLE_SOURCE

# `textsql evaluate` without the tables infer used: EX is n/a, and this line says what to pass.
NO_TABLES_HINT = (
    "EX n/a: no table rows known for these predictions (no metrics.json of `textsql infer` beside them); pass "
    "--tables FILE.tables.jsonl (a prepared dataset's tables/SPLIT.tables.jsonl) or --gold the release question file"
)


@click.command(cls=Command, short_help="Write SQL for questions (notebook 03).")
@renamed_option("--data", "--data-dir", "textsql infer --data-dir DIR (or --source NAME, --questions-file FILE)")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    help="A `textsql train` run: its model/ answers, and predictions.jsonl and metrics.json are written into it.",
)
@click.option(
    "--model",
    help="Trained model directory or a hub id of a fine-tuned T5 (`default`: the untrained embedded T5, which only "
    "checks the pipeline) [default: RUN_DIR/model].",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="The questions of a `textsql prepare --data-dir DIR`, as it tokenized them.",
)
@click.option(
    "--source",
    help="The questions of a source, as `textsql prepare --source` names it: sample, synthetic, hub, a release "
    "directory [default: sample, without --data-dir or --questions-file].",
)
@click.option(
    "--questions-file",
    type=click.Path(exists=True, dir_okay=False),
    help="A .jsonl of records: question and header; id, table_id, sql, types and rows when known.",
)
@click.option(
    "--split",
    type=click.Choice(["train", "validation", "test"]),
    default="test",
    show_default=True,
    help="Split to answer (validation is what training evaluates).",
)
@click.option(
    "--predictions-file",
    type=click.Path(dir_okay=False),
    help="Predictions file; metrics.json goes beside it [default: RUN_DIR/predictions.jsonl].",
)
@click.option(
    "--official-file",
    type=click.Path(dir_okay=False),
    help="Also write the predictions in the official WikiSQL format to this file.",
)
@field_option(GenerationOptions, "batch_size", type=click.IntRange(min=1))
@field_option(GenerationOptions, "num_beams", type=click.IntRange(min=1))
@field_option(GenerationOptions, "max_new_tokens", type=click.IntRange(min=1))
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N questions.")
@click.option("--question", help="Answer this one question instead of a split (with --header).")
@click.option("--header", help="With --question: the table's column names, 'A,B,C' or a JSON list.")
@click.option(
    "--input-format",
    type=click.Choice(INPUT_FORMATS),
    help="Model input form [default: as recorded with the model, else schema].",
)
@click.option("--device", help="cuda, cpu, ... [default: cuda when present].")
@field_option(GenerationOptions, "constrained")
@field_option(GenerationOptions, "execution_guided")
def infer(
    run_dir: str | None,
    model: str | None,
    split: str,
    predictions_file: str | None,
    official_file: str | None,
    limit: int | None,
    question: str | None,
    header: str | None,
    input_format: str | None,
    device: str | None,
    **options: Any,
) -> None:
    """Write SQL for a split's questions into the run (predictions.jsonl, metrics.json), or answer one --question."""
    if question is not None and header is None:
        raise click.UsageError("--question needs --header 'Column A,Column B,...'")
    data = _questions(options.pop("data_dir"), options.pop("source"), options.pop("questions_file"))
    if model is None and run_dir is None:
        raise click.UsageError("no model; pass --run-dir RUN (a `textsql train` run) or --model DIR")
    if predictions_file is None and run_dir is None and question is None:
        raise click.UsageError("nowhere to write; pass --run-dir RUN or --predictions-file FILE")
    model_dir = model or _run_model(str(run_dir))
    # The model's stack (seconds of torch and transformers to import) only once the command line is known good.
    import json

    from textsql.inference.predict import format_summary, parse_header, predict
    from textsql.inference.predictor import Predictor

    predictor = Predictor.load(model_dir, input_format=input_format, device=device)
    if question is not None and header is not None:
        generation = GenerationOptions(**options)
        click.echo(json.dumps(predictor.ask(question, parse_header(header), generation), ensure_ascii=False))
        return
    out = predictions_file or Path(str(run_dir)) / PREDICTIONS_NAME
    summary = predict(predictor, data, split, out, GenerationOptions(**options), limit, official_file)
    click.echo(format_summary(summary))


def _questions(data_dir: str | None, source: str | None, questions_file: str | None) -> str:
    """The one place infer's questions come from: the option given, or the shipped sample."""
    given = [value for value in (data_dir, source, questions_file) if value is not None]
    if len(given) > 1:
        raise click.UsageError("pass only one of --data-dir, --source and --questions-file")
    if data_dir is not None:
        _check_prepared(data_dir)
    return given[0] if given else SAMPLE_SOURCE


def _check_prepared(data_dir: str) -> None:
    """Refuse a --data-dir that holds no `textsql prepare` output, before the model loads."""
    from textsql.errors import DataError

    path = Path(data_dir).expanduser()
    if not (path / PREPARE_JSON_NAME).is_file():
        why = f"no {PREPARE_JSON_NAME}" if path.is_dir() else "no such directory"
        raise DataError(
            f"no prepared dataset at {data_dir!r} ({why}); run `textsql prepare --data-dir DIR` first, "
            "or pass --source NAME or --questions-file FILE"
        )


def _run_model(run_dir: str) -> Path:
    """The model a --run-dir holds, refused in one line when the directory or its model/ is missing."""
    from textsql.errors import ModelError

    path = Path(run_dir).expanduser()
    if not path.is_dir():
        raise ModelError(f"no run directory {run_dir!r}; pass --run-dir a `textsql train` run, or --model DIR")
    if not (path / MODEL_SUBDIR).is_dir():
        raise ModelError(
            f"run directory {run_dir!r} holds no {MODEL_SUBDIR}/ (its training has not finished); pass --run-dir "
            "a finished run, or --model DIR"
        )
    return path / MODEL_SUBDIR


@click.command(cls=Command, short_help="Score predictions (WikiSQL's metrics).")
@renamed_option("--pred", "--predictions-file", "textsql evaluate --predictions-file FILE")
@click.option(
    "--gold",
    type=click.Path(exists=True, dir_okay=False),
    help="Release question file (dev.jsonl) or our records [default: the questions `textsql infer` answered, as the "
    "metrics.json beside --predictions-file records them, else the gold queries inside our predictions.jsonl].",
)
@click.option(
    "--predictions-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Official predictions or our predictions.jsonl.",
)
@click.option(
    "--tables",
    type=click.Path(exists=True, dir_okay=False),
    help="Tables with rows for execution accuracy [default: GOLD's .tables.jsonl beside it, else the tables "
    "`textsql infer` read, else tables in the records].",
)
@click.option("--ordered/--no-ordered", help="Conditions must come in the gold order (official --ordered).")
@click.option("--json/--no-json", help="Print the full JSON report instead of a table.")
@click.option("--report-file", type=click.Path(dir_okay=False), help="Also write the JSON report to this file.")
def evaluate(
    gold: str | None, predictions_file: str, tables: str | None, ordered: bool, json: bool, report_file: str | None
) -> None:
    """Score predictions with WikiSQL's logical-form and execution accuracy; `textsql infer`'s predictions against
    the questions and tables it answered (as the metrics.json beside them records), unless --gold or --tables."""
    from json import dumps

    from textsql.data.tables import tables_beside
    from textsql.inference.predict import answered_questions
    from textsql.json_files import write_json
    from textsql.scoring.evaluate import evaluate as score
    from textsql.scoring.evaluate import format_report

    answered = answered_questions(predictions_file) if gold is None and tables is None else None
    if answered is not None:
        report = score(answered.items, predictions_file, answered.tables, ordered=ordered)
    else:
        report = score(gold, predictions_file, tables or (gold and tables_beside(gold)), ordered=ordered)
    if report_file:
        write_json(report_file, report)
    click.echo(dumps(report, indent=2) if json else format_report(report))
    if report["ex_accuracy"] is None and answered is None and tables is None:
        click.echo(NO_TABLES_HINT, err=True)
