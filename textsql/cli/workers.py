"""The worker pods' commands: ``rendezvous serve`` on the master and ``rendezvous register`` on each worker
bring a run's workers together; ``workers cleanup`` removes the pods (or Slurm jobs) a dead kernel left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from textsql.cli.help import PipelineGroup
from textsql.console import counted
from worker.constants import MAX_EXPECTED_WORKERS, MAX_SLOTS

# rendezvous: the master serves before workers register.
SUBCOMMAND_ORDER = ("serve", "register")


@click.group(cls=PipelineGroup, order=SUBCOMMAND_ORDER, short_help="Bring a run's workers together.")
def rendezvous() -> None:
    """Authenticated worker registration: `serve` on the master, `register` on each worker."""


@rendezvous.command(short_help="On the master: wait for the workers.")
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
    click.echo(f"{counted(len(workers), 'worker')} registered; wrote {options['hostfile']}")


@rendezvous.command(short_help="On a worker: register with the master.")
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


@click.group(cls=PipelineGroup, short_help="Clean up worker pods outside a run.")
def workers() -> None:
    """Worker pods outside a run: `cleanup` removes what a dead kernel left behind."""


@workers.command(short_help="End a dead run's Kubernetes objects or Slurm jobs.")
@click.option(
    "--backend",
    type=click.Choice(["kubernetes", "slurm"]),
    default="kubernetes",
    show_default=True,
    help="Where the workers ran.",
)
@click.option("--namespace", default="default", show_default=True, help="Namespace the worker pods ran in.")
@click.option(
    "--run",
    help="Only this run's workers (the `textsql/run` label; Slurm: the job names' textsql-RUN- prefix) "
    "[default: every textsql run].",
)
def cleanup(backend: str, namespace: str, run: str | None) -> None:
    """Delete the Kubernetes worker Pods, token Secrets and NetworkPolicy of a run, found by their labels; or
    cancel a run's Slurm worker jobs, found by their names."""
    if backend == "slurm":
        from worker.backends import slurm

        cancelled = slurm.cleanup(run)
        click.echo(f"cancelled {counted(len(cancelled), 'Slurm job')}{': ' + ' '.join(cancelled) if cancelled else ''}")
        return
    from worker.backends import kubernetes

    removed = kubernetes.cleanup(kubernetes.connect(), namespace, run)
    click.echo(f"deleted {removed} in namespace {namespace}")
