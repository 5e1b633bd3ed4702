"""The ssh client settings of a run, in one place for every way ssh is called.

The run's ssh_config (:mod:`worker.runfiles`), the static backend's probe of existing hosts, the
cluster's ``ssh``/pdsh environment and ``textsql launch`` all take their options from here, so a
worker is reached the same way whichever of them connects: host key verified against known_hosts
only, and never a prompt (a password or passphrase prompt would hang pdsh on every host).

Usage::

    >>> ssh_options(Path("runs/r1/ssh_config"))
    ['-F', 'runs/r1/ssh_config', '-o', 'BatchMode=yes']
    >>> subprocess.run(ssh_argv(ssh_options(port=22, known_hosts=Path("~/.ssh/known_hosts").expanduser()), "node1", "hostname"))
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
SERVER_ALIVE_INTERVAL_S = 15


def config_path(path: Path) -> str:
    """A path as an ssh setting's value: absolute, quoted, ``%`` escaped.

    ssh expands %-tokens in IdentityFile and UserKnownHostsFile and splits a value at spaces unless
    quoted, in an ssh_config and in ``-o`` alike.

    :param path: a file path.
    :rtype: str
    """
    return '"' + str(Path(path).resolve()).replace("%", "%%") + '"'


def ssh_settings(
    *,
    port: int | None = None,
    user: str | None = None,
    identity_file: Path | None = None,
    known_hosts: Path | None = None,
    connect_timeout: int = CONNECT_TIMEOUT_S,
) -> dict[str, str]:
    """ssh settings (``{Name: value}``, in ssh_config syntax) for reaching a worker without a prompt.

    :param port: the host's sshd port (None: ssh's default or the config's).
    :param user: login name (None: ssh's default).
    :param identity_file: the private key to log in with, and no other (None: ssh's defaults).
    :param known_hosts: verify host keys against this file only (None: leave host key checking to
        the ssh_config in use).
    :param connect_timeout: seconds for a connection, with ``known_hosts``.
    :rtype: dict[str, str]
    """
    settings = {}
    if port is not None:
        settings["Port"] = str(port)
    if user:
        settings["User"] = user
    if identity_file is not None:
        settings |= {"IdentityFile": config_path(identity_file), "IdentitiesOnly": "yes"}
    if known_hosts is None:
        return settings | {"BatchMode": "yes"}
    # CheckHostIP off: workers are known by the address they registered, one known_hosts line each.
    return settings | {
        "UserKnownHostsFile": config_path(known_hosts),
        "GlobalKnownHostsFile": "/dev/null",
        "StrictHostKeyChecking": "yes",
        "CheckHostIP": "no",
        "BatchMode": "yes",
        "PasswordAuthentication": "no",
        "ConnectTimeout": str(connect_timeout),
        "ServerAliveInterval": str(SERVER_ALIVE_INTERVAL_S),
        "LogLevel": "ERROR",
    }


def ssh_options(config: Path | None = None, **settings: Any) -> list[str]:
    """ssh's command-line options for a run: ``-F config`` when given, then ``-o Name=value``.

    :param config: an ssh_config to read instead of the user's own (the run's, with every worker's
        host key pinned).
    :param settings: the keyword arguments of :func:`ssh_settings`.
    :rtype: list[str]
    """
    options = ["-F", str(config)] if config is not None else []
    for name, value in ssh_settings(**settings).items():
        options += ["-o", f"{name}={value}"]
    return options


def ssh_argv(options: Sequence[str], host: str, *remote: str) -> list[str]:
    """``ssh OPTIONS -- HOST [REMOTE...]``: every ssh command the master runs, so a host named like an option
    (``-oProxyCommand=...`` in a hostfile) is only ever a host, never an option ssh acts on here.

    :param options: ssh's options (:func:`ssh_options`; ``-G`` for its resolved settings).
    :param host: the host to reach.
    :param remote: the command to run there (none for ``-G``).
    :rtype: list[str]
    """
    return ["ssh", *options, "--", host, *remote]
