"""Checks before anything starts: what the runtime has for the notebooks (:func:`check_runtime`), and
before a pdsh launch, pdsh and ssh installed and every host reachable (:func:`preflight`).

:func:`check_runtime` looks at this machine only and reports each need as one line with its fix: pdsh
and the ssh client for DeepSpeed's launcher, sshd for the worker pods (they run in the same runtime),
GPUs when the workers ask for them, and the model hub when a model or the data come from it. It never
raises: ``textsql preflight``, the AMP and a notebook decide which stage's needs must be met now.

Each host must verify its host key (``StrictHostKeyChecking yes``: the run's ssh_config pins the
keys the workers reported through the authenticated rendezvous) and accept the run's key without a
password, with exactly the ssh options pdsh will use. DeepSpeed's own reachability check runs a plain
``ssh host hostname`` that ignores ``PDSH_SSH_ARGS_APPEND``, so the launch replaces it with this one
and switches it off with ``--no_ssh_check``.

Usage::

    >>> print(format_checks(check_runtime(model="default", source="sample", backend="local", worker_gpus=0)))
    ok       pdsh       /usr/bin/pdsh (DeepSpeed's launcher)
    ...
    >>> options = preflight(["127.0.0.2", "127.0.0.3"], Path("runs/r1"), cluster.ssh_config)
    >>> options
    ['-F', '/tmp/textsql-r1-x1y2/ssh_config', '-o', 'BatchMode=yes']
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from textsql.constants import HUB_SOURCE
from textsql.errors import LaunchError
from worker.constants import INSTALL_SSH_HINT, SSH_CONFIG_NAME, SSHD_PATH
from worker.ssh import ssh_argv, ssh_options

logger = logging.getLogger(__name__)

SSH_CHECK_TIMEOUT_S = 20.0
# Stages whose needs check_runtime reports: notebook 01 (`textsql prepare`) and 02 (`textsql launch`).
PREPARE, TRAIN = "prepare", "train"
STAGES = (PREPARE, TRAIN)
# Long enough for a slow proxy, short enough that an offline runtime learns it at once.
HUB_TIMEOUT_S = 5.0
PDSH_HINT = (
    "Cloudera's runtimes lack it: build a custom runtime that adds the Debian packages pdsh openssh-server "
    "openssh-client (docker/Dockerfile's apt-get line); on Debian `apt-get install -y pdsh` or `make setup`"
)
SLURM_HINT = "run the notebooks on a Slurm login node, or in a JupyterLab on the cluster that may submit jobs"
LOCAL_MODEL_HINT = (
    'set model to "default" (the small T5 shipped in the project) or a model directory in the project '
    "(-p model=..., TEXTSQL_MODEL on CML)"
)


@dataclass(frozen=True)
class Check:
    """One thing a stage needs from the runtime, and whether it is there.

    :param name: what is checked (``pdsh``, ``sshd``, ``GPUs``, ``model hub``).
    :param ok: True when present, False when missing, None when it cannot be told from this machine.
    :param detail: what was found, or what is missing and the fix.
    :param needed_by: the stages that need it (empty: none does, as chosen).
    """

    name: str
    ok: bool | None
    detail: str
    needed_by: tuple[str, ...] = ()

    def line(self) -> str:
        """The check as one line: status, name, detail.

        :rtype: str
        """
        status = {True: "ok", False: "MISSING", None: "check"}[self.ok]
        return f"{status:8} {self.name:10} {self.detail}"


def check_runtime(
    model: str,
    source: str,
    backend: str,
    worker_gpus: int,
    training_model: str | None = None,
    hub_url: str | None = None,
    hub_timeout: float = HUB_TIMEOUT_S,
) -> list[Check]:
    """What this runtime has and lacks for preparing (notebook 01) and training (notebook 02).

    :param model: notebook 01's model (its tokenizer).
    :param source: notebook 01's WikiSQL source (``sample``, ``hub`` or a directory).
    :param backend: notebook 02's worker backend; ``static`` hosts run their own sshd; ``slurm`` needs ``sbatch``.
    :param worker_gpus: GPUs each worker asks for.
    :param training_model: notebook 02's model [default: ``model``].
    :param hub_url: the model hub [default: ``HF_ENDPOINT``, else https://huggingface.co].
    :param hub_timeout: seconds to wait for the hub.
    :rtype: list[Check]
    """
    checks = [
        _tool_check("pdsh", "pdsh", "DeepSpeed's launcher", PDSH_HINT),
        _tool_check("ssh", "ssh", "pdsh's remote shell", INSTALL_SSH_HINT),
    ]
    if backend == "static":
        checks.append(Check("sshd", True, "not needed here: static hosts run their own sshd"))
    else:
        checks.append(_tool_check("sshd", SSHD_PATH, f"each {backend} worker pod's own sshd", INSTALL_SSH_HINT))
    if backend == "slurm":
        checks.append(_tool_check("sbatch", "sbatch", "submits the worker jobs", SLURM_HINT))
    checks.append(_gpu_check(backend, worker_gpus))
    hub_needs = {
        PREPARE: [name for name in (model,) if _from_hub(name)]
        + ([f"source {HUB_SOURCE}"] if source == HUB_SOURCE else []),
        TRAIN: [name for name in (training_model or model,) if _from_hub(name)],
    }
    checks.append(
        _hub_check(hub_needs, hub_url or os.environ.get("HF_ENDPOINT") or "https://huggingface.co", hub_timeout)
    )
    return checks


def format_checks(checks: Iterable[Check]) -> str:
    """One line per check.

    :rtype: str
    """
    return "\n".join(check.line() for check in checks)


def missing_for(checks: Iterable[Check], stages: Iterable[str]) -> list[Check]:
    """The checks that failed and that one of ``stages`` needs.

    :rtype: list[Check]
    """
    wanted = set(stages)
    return [check for check in checks if check.ok is False and wanted & set(check.needed_by)]


def _tool_check(name: str, command: str, role: str, hint: str) -> Check:
    found = command if os.path.isabs(command) and os.access(command, os.X_OK) else shutil.which(command)
    if found:
        return Check(name, True, f"{found} ({role})", (TRAIN,))
    return Check(name, False, f"{command} is not installed ({role}); {hint}", (TRAIN,))


def _gpu_check(backend: str, worker_gpus: int) -> Check:
    if worker_gpus <= 0:
        return Check("GPUs", True, "not asked for: worker_gpus 0 trains on CPUs (DeepSpeed's CPU accelerator, gloo)")
    import torch

    asked = f"worker_gpus {worker_gpus} asks {worker_gpus} per worker"
    if torch.version.cuda is None:
        return Check(
            "GPUs",
            False,
            f"{asked}, but torch {torch.__version__} here is a CPU build; install torch's CUDA wheel "
            "(docs/guides/gpus.md, Installing on a GPU machine) or set worker_gpus 0",
            (TRAIN,),
        )
    visible = torch.cuda.device_count()
    if visible:
        return Check("GPUs", True, f"{visible} visible here ({torch.cuda.get_device_name(0)}); {asked}", (TRAIN,))
    if backend == "local":
        return Check(
            "GPUs",
            False,
            f"{asked}, but local workers run on this machine and it has no GPU; set worker_gpus 0",
            (TRAIN,),
        )
    return Check(
        "GPUs",
        None,
        f"{asked}; none is visible in this session, so the {backend} workers need GPU nodes: "
        "without them set worker_gpus 0",
        (TRAIN,),
    )


def _from_hub(model: str) -> bool:
    """Whether loading ``model`` needs the hub: a hub id that is neither a directory here nor in the local cache."""
    if model in (None, "", "default") or str(model).startswith((".", "/", "~")) or Path(str(model)).exists():
        return False
    from huggingface_hub import try_to_load_from_cache

    return not isinstance(try_to_load_from_cache(str(model), "config.json"), str)


def _hub_check(needs: dict[str, list[str]], url: str, timeout: float) -> Check:
    needed_by = tuple(stage for stage, names in needs.items() if names)
    if not needed_by:
        return Check("model hub", True, "not needed: the models and data chosen are in the project or the local cache")
    wanted = list(dict.fromkeys(name for names in needs.values() for name in names))
    reason = _unreachable(url, timeout)
    if reason is None:
        return Check("model hub", True, f"{url} answers (for {', '.join(wanted)})", needed_by)
    fixes = ([LOCAL_MODEL_HINT] if any(not name.startswith("source ") for name in wanted) else []) + (
        ["set source to sample or a release directory"] if f"source {HUB_SOURCE}" in wanted else []
    )
    return Check(
        "model hub",
        False,
        f"{url} is unreachable from here ({reason}), and {' and '.join(wanted)} "
        f"needs it to {' and '.join(needed_by)}: {'; '.join(fixes)}",
        needed_by,
    )


def _unreachable(url: str, timeout: float) -> str | None:
    """Why ``url`` cannot be reached, or None when it answers (any HTTP status counts as an answer)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return f"no answer in {timeout:g} s" if isinstance(reason, TimeoutError) else str(reason)


def preflight(
    hosts: Sequence[str], run_dir: Path, ssh_config: Path | None = None, ssh_port: int | None = None
) -> list[str]:
    """Check pdsh, ssh and every host; the ssh options pdsh is to run with for this launch.

    :param hosts: the hostfile's hosts.
    :param run_dir: the run directory (an ``ssh_config`` there is never read: the workers may write it).
    :param ssh_config: the ssh_config to use (must exist; None: the user's own ssh configuration).
    :param ssh_port: sshd port of every host, when the config does not give it.
    :rtype: list[str]
    :raises LaunchError: naming what to install, start or fix; nothing has started then.
    """
    if shutil.which("pdsh") is None:
        raise LaunchError("pdsh is not installed; run `make setup` (Debian package pdsh) or pass --launcher local")
    if shutil.which("ssh") is None:
        raise LaunchError("ssh is not installed; run `make setup` (Debian package openssh-client)")
    options = launch_ssh_options(run_dir, ssh_config, ssh_port)
    for host in hosts:
        checking = _ssh_setting(options, host, "stricthostkeychecking")
        if checking not in ("true", "ask"):
            raise LaunchError(
                f"ssh to {host!r} would not verify its host key (StrictHostKeyChecking {checking}); "
                "use the run's ssh_config, which pins the workers' keys from the rendezvous"
            )
    _check_reachable(options, hosts)
    return options


def launch_ssh_options(run_dir: Path, ssh_config: Path | None = None, ssh_port: int | None = None) -> list[str]:
    """The ssh options of a launch (what pdsh runs with): the ssh_config given, the port.

    :param run_dir: the run directory (an ``ssh_config`` there is never read: the workers may write it).
    :param ssh_config: the ssh_config to use (must exist; None: the user's own ssh configuration).
    :param ssh_port: sshd port of every host, when the config does not give it.
    :rtype: list[str]
    :raises LaunchError: when a given ssh_config is missing, or its path has whitespace.
    """
    return ssh_options(_run_ssh_config(run_dir, ssh_config), port=ssh_port)


def _run_ssh_config(run_dir: Path, ssh_config: Path | None) -> Path | None:
    """The ssh_config the launch runs ssh with: the one given, else none (the user's own ssh configuration).

    Never the run directory's: the workers may write it (a shared volume, the store guide's NFS), and ssh runs what
    an ssh_config says on the master (``Match exec``, ``ProxyCommand``), ``ssh -G`` included. The workers' own
    ssh_config, which start_workers writes in a private directory, reaches the launch by path (``--ssh-config``,
    or the supervisor's cluster).
    """
    if ssh_config is None:
        planted = run_dir / SSH_CONFIG_NAME
        if os.path.lexists(planted):
            logger.warning(
                "%s is not read: the workers may write the run directory; pass --ssh-config for the workers' own",
                planted,
            )
        else:
            logger.info("no --ssh-config: ssh uses your own configuration")
        return None
    if not ssh_config.is_file():
        raise LaunchError(
            f"ssh config {str(ssh_config)!r} does not exist; start the workers first or pass --ssh-config"
        )
    resolved = ssh_config.resolve()
    # pdsh splits PDSH_SSH_ARGS_APPEND at whitespace, quotes or not.
    if re.search(r"\s", str(resolved)):
        raise LaunchError(
            f"ssh config path {str(resolved)!r} has whitespace, which pdsh splits; use a run dir without spaces"
        )
    return resolved


def _check_reachable(options: list[str], hosts: Sequence[str]) -> None:
    # All hosts at once: a cluster's worth of sequential ssh handshakes would delay every launch.
    checks = {
        host: subprocess.Popen(
            ssh_argv(options, host, "true"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in hosts
    }
    failed = []
    for host, check in checks.items():
        try:
            _, error = check.communicate(timeout=SSH_CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            check.kill()
            _, error = check.communicate()
            error = f"no answer in {SSH_CHECK_TIMEOUT_S:.0f} s"
        if check.returncode != 0:
            reason = error.strip().splitlines()[-1] if error.strip() else f"exit code {check.returncode}"
            failed.append(f"{host} ({reason})")
    if failed:
        raise LaunchError(
            f"passwordless ssh failed for {', '.join(failed)} with `{shlex.join(ssh_argv(options, 'HOST', 'true'))}`; "
            "check that the workers are running and the run's ssh_config/known_hosts are theirs"
        )


def _ssh_setting(options: list[str], host: str, name: str) -> str:
    """The value ssh would use for one setting when connecting to host (``ssh -G``: no connection)."""
    result = subprocess.run(ssh_argv(["-G", *options], host), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LaunchError(
            f"ssh cannot read its configuration for {host!r}: {result.stderr.strip()}; fix the ssh_config"
        )
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return value
    return ""
