"""The data command: ``prepare`` loads WikiSQL, renders its SQL and saves the tokenized splits (notebook 01)."""

from __future__ import annotations

from typing import Any

import click

from textsql.arguments import PrepareArguments
from textsql.cli.help import Command
from textsql.cli.options import field_option, renamed_option
from textsql.constants import INPUT_FORMATS


@click.command(cls=Command, short_help="Tokenize WikiSQL for T5 (notebook 01).")
@renamed_option("--out", "--data-dir", "textsql prepare --data-dir DIR")
@field_option(PrepareArguments, "source")
@field_option(PrepareArguments, "data_dir", type=click.Path(file_okay=False))
@field_option(PrepareArguments, "model", flag="--tokenizer")
@field_option(PrepareArguments, "input_format", type=click.Choice(INPUT_FORMATS))
@field_option(PrepareArguments, "num_proc", type=click.IntRange(min=1))
@field_option(PrepareArguments, "max_source_length", type=click.IntRange(min=2))
@field_option(PrepareArguments, "max_target_length", type=click.IntRange(min=2))
@field_option(PrepareArguments, "limit", type=click.IntRange(min=1))
@field_option(PrepareArguments, "overwrite")
def prepare(tokenizer: str, **options: Any) -> None:
    """Load WikiSQL, render SQL targets, tokenize for T5 and save the splits with save_to_disk."""
    from textsql.data.prepare import format_summary
    from textsql.data.prepare import prepare as run_prepare

    click.echo(format_summary(run_prepare(PrepareArguments(model=tokenizer, **options))))
