"""The training commands: ``train`` (one process), ``launch`` (every rank, supervised), ``estimate`` (which
DeepSpeed profile fits) and ``tensorboard`` (watch a run's events).

Each command imports its stage inside its body, so ``textsql train -h`` and ``textsql launch --help`` import
neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from textsql.cli.help import Command, SectionedCommand, TrainCommand
from textsql.cli.options import ProfileType, field_option
from textsql.constants import DEFAULT_MAX_RESTARTS, DEFAULT_REPLACE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S
from textsql.launching.command import LAUNCHERS, LaunchArguments
from textsql.launching.stall import SHORTEST_STALL_TIMEOUT_S

# `textsql launch --help`: its options by what they are about (click.Command lists them in one block).
LAUNCH_SECTIONS = {
    "Run": ("run_dir", "module", "env", "checkpoint_store"),
    "Hosts and ssh": ("launcher", "hostfile", "ssh_config", "ssh_port", "ranks"),
    "Distributed": ("master_addr", "master_port", "socket_ifname"),
    "Recovery": ("max_restarts", "stall_timeout", "min_workers", "replace_timeout"),
}


def _help_all(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from textsql.training.train import main

        ctx.exit(main(["--help"]))


@click.command(
    cls=TrainCommand,
    short_help="Fine-tune in this one process.",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--help-all",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_help_all,
    help="Every flag (transformers' Seq2SeqTrainingArguments too) with its default, and exit.",
)
@field_option(LaunchArguments, "checkpoint_store")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(args: tuple[str, ...], checkpoint_store: str | None) -> None:
    """Fine-tune in this one process; `textsql launch` runs it on every rank.

    The flags are those of `python -m textsql.training.train`: HfArgumentParser over the model, data and run
    arguments plus Seq2SeqTrainingArguments, parsed strictly; --checkpoint-store is this command's own.
    """
    from textsql.planning.train_args import check_train_args

    # Checked as a launch checks them (the model's config, the prepared dataset), before DeepSpeed starts or the run
    # directory is made, and before the rank program's imports (seconds of torch, datasets and DeepSpeed).
    _, _, run_args, training = check_train_args(list(args))
    from textsql.store.uploads import store_uploads
    from textsql.training.train import main

    if checkpoint_store is None:
        raise SystemExit(main(list(args)))
    output, keep = Path(training["output_dir"]), training.get("save_total_limit")
    with store_uploads(
        checkpoint_store, output, keep, training.get("resume_from_checkpoint"), run_args.overwrite_output_dir
    ) as uploads:
        code = main(list(args))
        if code == 0 and uploads is not None:
            uploads.finish()
    raise SystemExit(code)


@click.command(
    cls=SectionedCommand,
    short_help="Train on every rank, supervised (notebook 02).",
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
@field_option(LaunchArguments, "checkpoint_store")
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

    --run-dir is the ranks' run directory too: after -- only training settings. The training arguments are
    checked first (profile, model, data_dir, flags), so a mistake is one line before any rank starts rather than
    one per rank on every host.
    """
    from textsql.launching.launch import parse_env
    from textsql.launching.supervisor import supervise

    given = {name: value for name, value in options.items() if value is not None}
    arguments = LaunchArguments(env=parse_env(env), train_args=list(train_args), **given)
    raise SystemExit(
        supervise(
            arguments,
            max_restarts=max_restarts,
            stall_timeout=stall_timeout,
            min_workers=min_workers,
            replace_timeout=replace_timeout,
        )
    )


@click.command(cls=Command, short_help="Which DeepSpeed profile fits in memory.")
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
    type=ProfileType(),
    multiple=True,
    help="Only this profile (repeatable) [default: every one in dsconfig/].",
)
@click.option("--cpu/--no-cpu", help="The ranks run on CPUs (--gpu-memory-gb is then host memory per rank).")
@click.option("--json/--no-json", help="Print the estimate as JSON.")
def estimate(
    model: str, nodes: int, gpus_per_node: int, gpu_memory_gb: float, profile: tuple[str, ...], cpu: bool, json: bool
) -> None:
    """Per-rank memory of each DeepSpeed profile for a model, from its config, and the cheapest that fits."""
    import contextlib
    import sys
    from json import dumps

    from textsql.planning.estimate import estimate as run_estimate
    from textsql.planning.estimate import format_estimate

    # DeepSpeed logs to stdout (its import announces the accelerator); stdout is for the report.
    with contextlib.redirect_stdout(sys.stderr):
        report = run_estimate(
            model, nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb, names=profile or None, cpu=cpu
        )
    click.echo(dumps(report, indent=2) if json else format_estimate(report))


@click.command(cls=Command, short_help="Serve TensorBoard on runs' event files.")
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
