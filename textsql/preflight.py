"""Checks before a pdsh launch starts anything: pdsh and ssh installed, every host reachable.

Each host must verify its host key (``StrictHostKeyChecking yes``: the run's ssh_config pins the
keys the workers reported through the authenticated rendezvous) and accept the run's key without a
password, with exactly the ssh options pdsh will use. DeepSpeed's own reachability check runs a plain
``ssh host hostname`` that ignores ``PDSH_SSH_ARGS_APPEND``, so the launch replaces it with this one
and switches it off with ``--no_ssh_check``.

Usage::

    >>> options = preflight(["127.0.0.2", "127.0.0.3"], Path("runs/r1"))
    >>> options
    ['-F', '/abs/runs/r1/ssh_config', '-o', 'BatchMode=yes']
"""
from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from textsql.errors import LaunchError
from worker.constants import SSH_CONFIG_NAME
from worker.ssh import ssh_options

logger = logging.getLogger(__name__)

SSH_CHECK_TIMEOUT_S = 20.0


def preflight(hosts: Sequence[str], run_dir: Path, ssh_config: Path | None = None, ssh_port: int | None = None) -> list[str]:
    """Check pdsh, ssh and every host; the ssh options pdsh is to run with for this launch.

    :param hosts: the hostfile's hosts.
    :param run_dir: the run directory (its ``ssh_config`` is used when present).
    :param ssh_config: an ssh_config to use instead (must exist).
    :param ssh_port: sshd port of every host, when the config does not give it.
    :rtype: list[str]
    :raises LaunchError: naming what to install, start or fix; nothing has started then.
    """
    if shutil.which("pdsh") is None:
        raise LaunchError("pdsh is not installed; run `make setup` (Debian package pdsh) or pass --launcher local")
    if shutil.which("ssh") is None:
        raise LaunchError("ssh is not installed; run `make setup` (Debian package openssh-client)")
    options = ssh_options(_run_ssh_config(run_dir, ssh_config), port=ssh_port)
    for host in hosts:
        checking = _ssh_setting(options, host, "stricthostkeychecking")
        if checking not in ("true", "ask"):
            raise LaunchError(
                f"ssh to {host!r} would not verify its host key (StrictHostKeyChecking {checking}); "
                "use the run's ssh_config, which pins the workers' keys from the rendezvous"
            )
    _check_reachable(options, hosts)
    return options


def _run_ssh_config(run_dir: Path, ssh_config: Path | None) -> Path | None:
    config = ssh_config or run_dir / SSH_CONFIG_NAME
    if not config.is_file():
        if ssh_config is not None:
            raise LaunchError(f"ssh config {str(config)!r} does not exist; start the workers first or pass --ssh-config")
        logger.info("no %s in %s: ssh uses your own configuration", SSH_CONFIG_NAME, run_dir)
        return None
    resolved = config.resolve()
    # pdsh splits PDSH_SSH_ARGS_APPEND at whitespace, quotes or not.
    if re.search(r"\s", str(resolved)):
        raise LaunchError(f"ssh config path {str(resolved)!r} has whitespace, which pdsh splits; use a run dir without spaces")
    return resolved


def _check_reachable(options: list[str], hosts: Sequence[str]) -> None:
    # All hosts at once: a cluster's worth of sequential ssh handshakes would delay every launch.
    checks = {
        host: subprocess.Popen(["ssh", *options, host, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
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
            f"passwordless ssh failed for {', '.join(failed)} with `{shlex.join(['ssh', *options, 'HOST', 'true'])}`; "
            "check that the workers are running and the run's ssh_config/known_hosts are theirs"
        )


def _ssh_setting(options: list[str], host: str, name: str) -> str:
    """The value ssh would use for one setting when connecting to host (``ssh -G``: no connection)."""
    result = subprocess.run(["ssh", "-G", *options, host], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LaunchError(f"ssh cannot read its configuration for {host!r}: {result.stderr.strip()}; fix the ssh_config")
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return value
    return ""
