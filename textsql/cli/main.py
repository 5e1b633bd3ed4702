"""The ``textsql`` group: its own options (--verbose, --version), the package's errors as one line, and the
commands of every stage in the order ``textsql --help`` lists them.

Each stage's commands live in their own module (``data``, ``training``, ``inference``, ``pipeline``,
``workers``); this one only gathers them, so a new command is one line in :data:`COMMANDS`.
"""

from __future__ import annotations

from typing import Any

import click

from textsql.cli import data, inference, pipeline, training, workers
from textsql.cli.help import PipelineGroup
from textsql.console import configure_cli
from textsql.errors import RenamedOptionError, TextSQLError

# The order of `textsql --help`: the whole pipeline at once, then its stages as a run meets them, then cleanup.
COMMANDS: tuple[click.Command, ...] = (
    pipeline.demo,
    pipeline.preflight,
    data.prepare,
    training.estimate,
    workers.rendezvous,
    training.launch,
    training.train,
    training.tensorboard,
    inference.infer,
    inference.evaluate,
    workers.workers,
)
COMMAND_ORDER = tuple(str(command.name) for command in COMMANDS)


class _Group(PipelineGroup):
    """Turns the package's own errors into click's one-line error output (no traceback); an option of the
    previous release is a usage error, as click's own are."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RenamedOptionError as error:
            raise click.UsageError(str(error)) from None
        except TextSQLError as error:
            raise click.ClickException(str(error)) from None


@click.group(
    "textsql",
    cls=_Group,
    order=COMMAND_ORDER,
    context_settings={"auto_envvar_prefix": "TEXTSQL", "help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name="textsql", prog_name="textsql")
@click.option(
    "-v",
    "--verbose/--no-verbose",
    help="Show third-party output (DeepSpeed, transformers, datasets, the notebooks' cells) and debug messages; the run's log files hold it either way.",
)
def cli(verbose: bool) -> None:
    """Fine-tune T5 for WikiSQL text-to-SQL with DeepSpeed across worker pods."""
    configure_cli(verbose)


for command in COMMANDS:
    cli.add_command(command)
