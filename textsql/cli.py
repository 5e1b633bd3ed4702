"""The `textsql` command: one group, one subcommand per stage.

Each subcommand parses its options and calls one function of the package, so notebooks, jobs and
the shell run the same code. A user mistake surfaces as one line on stderr and a non-zero exit.
"""
from __future__ import annotations

import logging

import click

from textsql.errors import TextSQLError


class _Group(click.Group):
    """Turns the package's own errors into click's one-line error output (no traceback)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TextSQLError as error:
            raise click.ClickException(str(error)) from None


@click.group(cls=_Group, context_settings={"auto_envvar_prefix": "TEXTSQL", "help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log debug messages.")
def cli(verbose: bool) -> None:
    """Fine-tune T5 for WikiSQL text-to-SQL with DeepSpeed across worker pods."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
