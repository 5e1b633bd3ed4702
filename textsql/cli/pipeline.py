"""The notebook pipeline's commands: ``demo`` runs the three notebooks end to end, ``preflight`` says what
this runtime lacks for them."""

from __future__ import annotations

import click

from textsql.cli.help import Command
from textsql.cli.options import notebook_parameter_option, renamed_option
from textsql.launching.preflight import STAGES


@click.command(cls=Command, short_help="Run the three notebooks end to end.")
@renamed_option("--out", "--run-dir", "textsql demo --run-dir DIR")
@click.option(
    "--run-dir",
    default="runs/demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Run directory for everything the demo writes (a previous demo there is replaced, unless --resume).",
)
@notebook_parameter_option("Notebook parameter, e.g. -p profile=zero3 or -p 03_inference.split=test.")
@click.option(
    "--resume/--no-resume",
    default=False,
    help="Continue the demo in --run-dir: skip each notebook that completed with the same parameters, resume "
    "training from its newest complete checkpoint, run the rest (and what a changed parameter affects).",
)
def demo(run_dir: str, parameter: tuple[str, ...], resume: bool) -> None:
    """Run the three notebooks with papermill on the embedded default: synthetic questions over the sample's
    tables (uncased), small T5, two local workers, profile auto; then the sample's real questions too."""
    from textsql.pipeline.demo import format_summary, run_demo
    from textsql.pipeline.parameters import parse_overrides

    click.echo(format_summary(run_demo(run_dir, parse_overrides(list(parameter)), continue_demo=resume)))


@click.command(cls=Command, short_help="Say what this runtime lacks for a run.")
@click.option(
    "--require",
    type=click.Choice(STAGES),
    multiple=True,
    help="Fail only when what this stage needs is missing; the rest is reported [default: every stage].",
)
@notebook_parameter_option(
    "Notebook parameter to check with, as `textsql demo -p` [default: the notebooks' own and TEXTSQL_<NAME>]."
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    help="A run whose workers registered: its cluster check's hosts, all-reduce bandwidth and problems [default: this machine only].",
)
def preflight(require: tuple[str, ...], parameter: tuple[str, ...], run_dir: str | None) -> None:
    """Say what this runtime lacks for the notebooks (pdsh, sshd, GPUs, model hub), one line each with its fix,
    then the cluster check's table: this machine, and a run's hosts with their versions, accelerators,
    interfaces and all-reduce bandwidth."""
    from textsql.display.views import format_cluster
    from textsql.launching.preflight import format_checks, missing_for
    from textsql.pipeline.parameters import job_parameters, parse_overrides
    from textsql.pipeline.runs import runtime_checks

    checks = runtime_checks(job_parameters(parse_overrides(list(parameter))))
    click.echo(format_checks(checks))
    click.echo(format_cluster(run_dir))
    missing = missing_for(checks, require or STAGES)
    if missing:
        stages = sorted({stage for check in missing for stage in check.needed_by if stage in (require or STAGES)})
        raise click.ClickException(
            f"this runtime lacks {', '.join(check.name for check in missing)} to {' and '.join(stages)}; each fix is on its line above"
        )
