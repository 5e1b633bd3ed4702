"""The `textsql` command: one group, one subcommand per stage.

Each subcommand parses its options and calls one function of the package, so notebooks, jobs and
the shell run the same code. A user mistake surfaces as one line on stderr and a non-zero exit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import click

from textsql.arguments import GenerationOptions, PrepareArguments, argument_field, kebab_flag
from textsql.cli.help import COMMAND_ORDER, SUBCOMMAND_ORDER, PipelineGroup, SectionedCommand, TrainCommand
from textsql.console import configure_cli
from textsql.constants import DEFAULT_MAX_RESTARTS, DEFAULT_REPLACE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, INPUT_FORMATS
from textsql.errors import ProfileError, TextSQLError
from textsql.launching.command import LAUNCHERS, TRAIN_MODULE, LaunchArguments
from textsql.launching.preflight import STAGES
from textsql.launching.stall import SHORTEST_STALL_TIMEOUT_S
from textsql.training.profiles import available_profiles, profile_path
from worker.constants import MAX_EXPECTED_WORKERS, MAX_SLOTS

# `textsql launch --help`: its options by what they are about (click.Command lists them in one block).
LAUNCH_SECTIONS = {
    "Run": ("run_dir", "module", "env"),
    "Hosts and ssh": ("launcher", "hostfile", "ssh_config", "ssh_port", "ranks"),
    "Distributed": ("master_addr", "master_port", "socket_ifname"),
    "Recovery": ("max_restarts", "stall_timeout", "min_workers", "replace_timeout"),
}


class _Group(PipelineGroup):
    """Turns the package's own errors into click's one-line error output (no traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TextSQLError as error:
            raise click.ClickException(str(error)) from None


class ProfileType(click.ParamType):
    """A DeepSpeed profile: a name from ``dsconfig/``, read when the command runs (a new file is a new
    choice at once), or a path to a DeepSpeed ``.json`` file."""

    name = "profile"

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return f"[{'|'.join(available_profiles())}|FILE.json]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            profile_path(value)
        except ProfileError as error:
            self.fail(str(error), param, ctx)
        return str(value)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
        return [
            click.shell_completion.CompletionItem(name) for name in available_profiles() if name.startswith(incomplete)
        ]


def field_option(cls: type, name: str, flag: str | None = None, **attrs: Any) -> Callable[..., Any]:
    """``--the-name`` for the field ``name`` of an arguments dataclass, its help and default taken from the
    field, so the CLI and the dataclass cannot say different things; a boolean field is a ``--x/--no-x``
    flag. ``flag`` names the option where the field's name would mean something else on the command line
    (the function then gets it under the flag's name); ``attrs`` add click's type and the like.

    :rtype: typing.Callable
    """
    spec = argument_field(cls, name)
    flag = flag or kebab_flag(name)
    attrs.setdefault("help", spec.metadata["help"])
    if spec.default is not MISSING:
        attrs.setdefault("default", spec.default)
        attrs.setdefault("show_default", spec.default not in (None, False))
    elif spec.default_factory is MISSING:
        attrs.setdefault("required", True)
    if spec.type in (bool, "bool"):
        return click.option(f"{flag}/--no-{flag[2:]}", flag[2:].replace("-", "_"), **attrs)
    return click.option(flag, flag[2:].replace("-", "_"), **attrs)


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


@cli.command()
@field_option(PrepareArguments, "source")
@field_option(PrepareArguments, "out", type=click.Path(file_okay=False))
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


@cli.command()
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


@cli.command()
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

    from textsql.inference.predict import Predictor, format_summary, parse_header, predict

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


@cli.command()
@click.option(
    "--logdir",
    default="runs",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory searched recursively for event files.",
)
@click.option("--host", help="Address to bind [default: 127.0.0.1 on CML, else localhost].")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    help="Port [default: $CDSW_APP_PORT or $CDSW_READONLY_PORT on CML, else 6006; 0: any free port].",
)
def tensorboard(logdir: str, host: str | None, port: int | None) -> None:
    """Serve TensorBoard on the run's event files at the platform's address; prints the URL."""
    from textsql.display.tensorboard import serve_forever

    serve_forever(logdir, host=host, port=port)


def _help_all(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from textsql.training.train import main

        ctx.exit(main(["--help"]))


@cli.command(cls=TrainCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--help-all",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_help_all,
    help="Every flag (transformers' Seq2SeqTrainingArguments too) with its default, and exit.",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(args: tuple[str, ...]) -> None:
    """Fine-tune in this one process; `textsql launch` runs it on every rank.

    The flags are those of `python -m textsql.training.train`: HfArgumentParser over the model, data and run
    arguments plus Seq2SeqTrainingArguments, parsed strictly.
    """
    from textsql.training.train import main

    raise SystemExit(main(list(args)))


@cli.command(
    cls=SectionedCommand,
    sections=LAUNCH_SECTIONS,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@field_option(LaunchArguments, "run_dir", type=click.Path(file_okay=False))
@field_option(LaunchArguments, "launcher", type=click.Choice(LAUNCHERS))
@field_option(LaunchArguments, "hostfile", type=click.Path(dir_okay=False))
@field_option(LaunchArguments, "ssh_config", type=click.Path(dir_okay=False))
@field_option(LaunchArguments, "ssh_port", type=click.IntRange(1, 65535))
@field_option(LaunchArguments, "master_addr")
@field_option(LaunchArguments, "master_port", type=click.IntRange(1, 65535))
@field_option(LaunchArguments, "ranks", type=click.IntRange(min=1))
@field_option(LaunchArguments, "socket_ifname")
@field_option(LaunchArguments, "env", multiple=True, metavar="KEY=VALUE")
@field_option(LaunchArguments, "module")
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_RESTARTS,
    show_default=True,
    help="Relaunches after a failure, from the newest complete checkpoint (0: the first failure ends the run).",
)
@click.option(
    "--stall-timeout",
    type=click.FloatRange(min=SHORTEST_STALL_TIMEOUT_S),
    default=DEFAULT_STALL_TIMEOUT_S,
    help="Seconds no rank may advance before every rank is ended and the run relaunched "
    "[default: 4 x the slowest step seen, at least 120].",
)
@click.option(
    "--min-workers",
    type=click.IntRange(min=1),
    help="Fewest workers the run may go on with when a lost worker is not back within --replace-timeout, "
    "up to the hostfile's hosts [default: all]. Over a hostfile the hosts left go to RUN_DIR/hostfile.remaining; "
    "yours is not changed.",
)
@click.option(
    "--replace-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_REPLACE_TIMEOUT_S,
    show_default=True,
    help="Seconds a lost worker has to come back (a hostfile's host: answer ssh again; a worker started by "
    "notebook 02 or `textsql demo`: its replacement registered) before the run ends or goes on with fewer "
    "(see --min-workers).",
)
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
def launch(
    env: tuple[str, ...],
    train_args: tuple[str, ...],
    max_restarts: int,
    stall_timeout: float | None,
    min_workers: int | None,
    replace_timeout: float,
    **options: Any,
) -> None:
    """Train on every rank through DeepSpeed's launcher; TRAIN_ARGS (after --) go to `textsql train`.

    The training arguments are checked here first (profile, model, data_dir, flags), so a mistake is
    one line before any rank starts rather than one per rank on every host.
    """
    from textsql.launching.launch import parse_env
    from textsql.launching.supervisor import supervise

    given = {name: value for name, value in options.items() if value is not None}
    arguments = LaunchArguments(env=parse_env(env), train_args=list(train_args), **given)
    if arguments.module == TRAIN_MODULE:
        from textsql.training.command_line import check_train_args

        check_train_args(arguments.train_args)
    raise SystemExit(
        supervise(
            arguments,
            max_restarts=max_restarts,
            stall_timeout=stall_timeout,
            min_workers=min_workers,
            replace_timeout=replace_timeout,
        )
    )


@cli.group(order=SUBCOMMAND_ORDER)
def rendezvous() -> None:
    """Authenticated worker registration: `serve` on the master, `register` on each worker."""


@rendezvous.command()
@click.option(
    "--expect",
    type=click.IntRange(1, MAX_EXPECTED_WORKERS),
    required=True,
    help="Number of workers that complete the run.",
)
@click.option(
    "--token-file", type=click.Path(dir_okay=False), required=True, help="Per-run secret; created (0600) when missing."
)
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False),
    required=True,
    help="DeepSpeed hostfile to write; known_hosts and ssh_config go beside it.",
)
@click.option("--port", type=click.IntRange(0, 65535), help="Port to listen on (0: any free port) [default: 29400].")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on: the interface the workers reach (0.0.0.0: every interface).",
)
@click.option(
    "--timeout", type=click.FloatRange(min=0), default=300, show_default=True, help="Seconds to wait for every worker."
)
@click.option(
    "--identity-file",
    type=click.Path(dir_okay=False),
    help="Private key named in ssh_config [default: id_ed25519 beside the hostfile].",
)
@click.option("--hold/--no-hold", help="Keep holding the workers after writing the files, until interrupted.")
def serve(**options: Any) -> None:
    """Wait for --expect workers, then write the hostfile, known_hosts and ssh_config atomically."""
    from worker.rendezvous.server import serve as serve_rendezvous

    workers = serve_rendezvous(**options)
    click.echo(f"{len(workers)} workers registered; wrote {options['hostfile']}")


@rendezvous.command()
@click.option("--master", required=True, help="HOST:PORT of `textsql rendezvous serve`.")
@click.option("--token-file", type=click.Path(dir_okay=False), required=True, help="File holding the run's token.")
@click.option("--address", required=True, help="This worker's IP address, as other workers reach it.")
@click.option(
    "--slots",
    type=click.IntRange(1, MAX_SLOTS),
    default=1,
    show_default=True,
    help="Ranks on this worker (its GPUs; 1 without).",
)
@click.option(
    "--ssh-port", type=click.IntRange(1, 65535), help="Port of this worker's sshd (with --ssh-host-key-file)."
)
@click.option(
    "--ssh-host-key-file", type=click.Path(exists=True, dir_okay=False), help="This sshd's host public key (.pub)."
)
@click.option("--pod", help="The platform's name for this worker, reported back [default: the address].")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=60,
    show_default=True,
    help="Seconds to retry an unreachable master.",
)
@click.option("--wait/--no-wait", help="Hold the registration until the master releases it.")
def register(master: str, token_file: str, timeout: float, wait: bool, **fields: Any) -> None:
    """Register this worker; exit 0 once accepted, non-zero with the master's reason otherwise."""
    from worker.registration import registration_from_options
    from worker.rendezvous.client import register_once

    register_once(master, Path(token_file), registration_from_options(**fields), timeout, wait=wait)
    click.echo(f"registered {fields['address']} with {master}")


@cli.group()
def workers() -> None:
    """Worker pods outside a run: `cleanup` removes what a dead kernel left behind."""


@workers.command()
@click.option("--namespace", default="default", show_default=True, help="Namespace the worker pods ran in.")
@click.option("--run", "run_id", help="Only this run's objects (the `textsql/run` label) [default: every textsql run].")
def cleanup(namespace: str, run_id: str | None) -> None:
    """Delete the Kubernetes worker Pods, token Secrets and NetworkPolicy of a run, found by their labels."""
    from worker.backends import kubernetes

    removed = kubernetes.cleanup(kubernetes.connect(), namespace, run_id)
    click.echo(f"deleted {removed} in namespace {namespace}")


@cli.command()
@click.option(
    "--model",
    default="default",
    show_default=True,
    help="The model to fine-tune, as `textsql train --model`: a hub id, a model directory or a config.json file "
    "(only its config is read).",
)
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Worker nodes.")
@click.option(
    "--gpus-per-node", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs (ranks) per node."
)
@click.option(
    "--gpu-memory-gb", type=click.FloatRange(min=0, min_open=True), required=True, help="Memory of one GPU in GiB."
)
@click.option(
    "--profile",
    "names",
    type=ProfileType(),
    multiple=True,
    help="Only this profile (repeatable) [default: every one in dsconfig/].",
)
@click.option("--cpu/--no-cpu", help="The ranks run on CPUs (--gpu-memory-gb is then host memory per rank).")
@click.option("--json/--no-json", "as_json", help="Print the estimate as JSON.")
def estimate(
    model: str, nodes: int, gpus_per_node: int, gpu_memory_gb: float, names: tuple[str, ...], cpu: bool, as_json: bool
) -> None:
    """Per-rank memory of each DeepSpeed profile for a model, from its config, and the cheapest that fits."""
    import contextlib
    import json
    import sys

    from textsql.training.estimate import estimate as run_estimate
    from textsql.training.estimate import format_estimate

    # DeepSpeed logs to stdout (its import announces the accelerator); stdout is for the report.
    with contextlib.redirect_stdout(sys.stderr):
        report = run_estimate(
            model, nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb, names=names or None, cpu=cpu
        )
    click.echo(json.dumps(report, indent=2) if as_json else format_estimate(report))


@cli.command("preflight")
@click.option(
    "--require",
    type=click.Choice(STAGES),
    multiple=True,
    help="Fail only when what this stage needs is missing; the rest is reported [default: every stage].",
)
@click.option(
    "-p",
    "--parameter",
    "parameters",
    multiple=True,
    metavar="[NOTEBOOK.]NAME=VALUE",
    help="Notebook parameter to check with, as `textsql demo -p` [default: the notebooks' own and TEXTSQL_<NAME>].",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    help="A run whose workers registered: its cluster check's hosts, all-reduce bandwidth and problems [default: this machine only].",
)
def preflight_command(require: tuple[str, ...], parameters: tuple[str, ...], run_dir: str | None) -> None:
    """Say what this runtime lacks for the notebooks (pdsh, sshd, GPUs, model hub), one line each with its fix,
    then the cluster check's table: this machine, and a run's hosts with their versions, accelerators,
    interfaces and all-reduce bandwidth."""
    from textsql.display.views import format_cluster
    from textsql.launching.preflight import format_checks, missing_for
    from textsql.pipeline.parameters import job_parameters, parse_overrides
    from textsql.pipeline.runs import runtime_checks

    checks = runtime_checks(job_parameters(parse_overrides(list(parameters))))
    click.echo(format_checks(checks))
    click.echo(format_cluster(run_dir))
    missing = missing_for(checks, require or STAGES)
    if missing:
        stages = sorted({stage for check in missing for stage in check.needed_by if stage in (require or STAGES)})
        raise click.ClickException(
            f"this runtime lacks {', '.join(check.name for check in missing)} to {' and '.join(stages)}; each fix is on its line above"
        )


@cli.command()
@click.option(
    "--out",
    default="runs/demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Run directory for everything the demo writes (a previous demo there is replaced, unless --resume).",
)
@click.option(
    "-p",
    "--parameter",
    "parameters",
    multiple=True,
    metavar="[NOTEBOOK.]NAME=VALUE",
    help="Notebook parameter, e.g. -p profile=zero3 or -p 03_inference.split=test.",
)
@click.option(
    "--resume/--no-resume",
    default=False,
    help="Continue the demo in --out: skip each notebook that completed with the same parameters, continue "
    "training from its newest complete checkpoint, run the rest (and what a changed parameter affects).",
)
def demo(out: str, parameters: tuple[str, ...], resume: bool) -> None:
    """Run the three notebooks with papermill on the embedded default: synthetic questions over the sample's
    tables (uncased), small T5, two local workers, profile auto; then the sample's real questions too."""
    from textsql.pipeline.demo import format_summary, run_demo
    from textsql.pipeline.parameters import parse_overrides

    click.echo(format_summary(run_demo(out, parse_overrides(list(parameters)), continue_demo=resume)))
