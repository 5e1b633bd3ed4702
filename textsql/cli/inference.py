"""The inference commands: ``infer`` writes SQL for a split's questions or answers one, ``evaluate`` scores
predictions with WikiSQL's logical-form and execution accuracy (notebook 03)."""

from __future__ import annotations

import click

from textsql.arguments import GenerationOptions
from textsql.cli.help import Command
from textsql.cli.options import field_option
from textsql.constants import INPUT_FORMATS


@click.command(cls=Command)
@click.option(
    "--model",
    required=True,
    help="Trained model directory (OUTPUT_DIR/model of `textsql train`) or a hub id of a fine-tuned T5 "
    "(`default`: the untrained embedded T5, which only checks the pipeline).",
)
@click.option(
    "--data",
    default="sample",
    show_default=True,
    help="A `textsql prepare` directory, a records .jsonl, or a source: sample, hub, a release directory.",
)
@click.option(
    "--split",
    type=click.Choice(["train", "validation", "test"]),
    default="validation",
    show_default=True,
    help="Split to answer.",
)
@click.option(
    "--predictions-file",
    default="predictions.jsonl",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Predictions file; metrics.json goes beside it.",
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
    model: str,
    data: str,
    split: str,
    predictions_file: str,
    official_file: str | None,
    batch_size: int,
    num_beams: int,
    max_new_tokens: int,
    limit: int | None,
    question: str | None,
    header: str | None,
    input_format: str | None,
    device: str | None,
    constrained: bool,
    execution_guided: bool,
) -> None:
    """Write SQL for a split's questions (and metrics.json beside it), or answer one --question."""
    import json

    from textsql.inference.predict import format_summary, parse_header, predict
    from textsql.inference.predictor import Predictor

    if question is not None and header is None:
        raise click.UsageError("--question needs --header 'Column A,Column B,...'")
    options = GenerationOptions(
        batch_size=batch_size,
        num_beams=num_beams,
        max_new_tokens=max_new_tokens,
        constrained=constrained,
        execution_guided=execution_guided,
    )
    predictor = Predictor.load(model, input_format=input_format, device=device)
    if question is not None and header is not None:
        click.echo(json.dumps(predictor.ask(question, parse_header(header), options), ensure_ascii=False))
    else:
        click.echo(format_summary(predict(predictor, data, split, predictions_file, options, limit, official_file)))


@click.command(cls=Command)
@click.option(
    "--gold",
    type=click.Path(exists=True, dir_okay=False),
    help="Release question file (dev.jsonl) or our records [default: the gold queries inside our predictions.jsonl].",
)
@click.option(
    "--pred",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Official predictions or our predictions.jsonl.",
)
@click.option(
    "--tables",
    type=click.Path(exists=True, dir_okay=False),
    help="Tables with rows for execution accuracy [default: GOLD's .tables.jsonl beside it, else tables in the records].",
)
@click.option("--ordered/--no-ordered", help="Conditions must come in the gold order (official --ordered).")
@click.option("--json/--no-json", "as_json", help="Print the full JSON report instead of a table.")
@click.option("--report-file", type=click.Path(dir_okay=False), help="Also write the JSON report to this file.")
def evaluate(
    gold: str | None, pred: str, tables: str | None, ordered: bool, as_json: bool, report_file: str | None
) -> None:
    """Score predictions with WikiSQL's logical-form and execution accuracy."""
    import json

    from textsql.files import tables_beside, write_json
    from textsql.scoring.evaluate import evaluate as score
    from textsql.scoring.evaluate import format_report

    report = score(gold, pred, tables or (gold and tables_beside(gold)), ordered=ordered)
    if report_file:
        write_json(report_file, report)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
