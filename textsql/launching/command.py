"""DeepSpeed's launcher command for a launch, and the environment its ranks get.

``deepspeed --hostfile H --launcher pdsh --master_addr A --master_port M --no_ssh_check
--no_local_rank --module textsql.training.train ARGS`` (or without ``--launcher`` for the ranks of one machine).
The ranks' variables go to the run's ``.deepspeed_env`` (DeepSpeed's runner finds it through
``DS_ENV_FILE`` and exports each ``KEY=VAL`` line on pdsh's command line), so no credential may be
among them: names that look like one are refused here, and kept from the runner's own environment.

Usage::

    >>> command = deepspeed_command(arguments, run_dir / "hostfile", ["127.0.0.2", "127.0.0.3"])
    >>> write_deepspeed_env(run_dir / ".deepspeed_env", rank_environment(arguments, hosts, launch_id))
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from textsql.constants import DEFAULT_MASTER_PORT, DSCONFIG_DIR_VAR, PROJECT_DIR
from textsql.errors import LaunchError
from textsql.launching.ranks import LAUNCH_ID_VAR
from worker.constants import SOCKET_IFNAME_VARS
from worker.files import atomic_write
from worker.network import free_port

if TYPE_CHECKING:
    from textsql.launching.launch import LaunchArguments

logger = logging.getLogger(__name__)

# Variables a rank inherits from the launching environment when set there. Caches are carried only
# when set: unset, each host keeps its own default (torch's default extensions dir is
# ~/.cache/torch_extensions/py311_cpu, not the root it would get if set to the default root).
CARRIED_VARS = (
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TORCH_EXTENSIONS_DIR",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "DS_ACCELERATOR",
    DSCONFIG_DIR_VAR,
)
# Names that hold credentials: never written to .deepspeed_env (it ends up on pdsh's command line and
# in the log) and kept from DeepSpeed's runner, which exports every MLFLOW*/PYTHON*/... variable.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY", re.IGNORECASE)
# A password in a URL's user part (a proxy, a package index, a tracking URI): a credential whatever
# the variable is called. Group 1 is what stays visible when it is masked.
URL_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^/\s:@]*):[^/\s@]+@", re.IGNORECASE)
MASK = "***"
# Characters that reach a rank unchanged through pdsh (which fills in %h, %n, %u) and the hosts' shell
# (DeepSpeed double-quotes an argument with spaces).
SHELL_SAFE = re.compile(r"[\w@+=:,./ -]+")


def deepspeed_command(arguments: LaunchArguments, hostfile: Path, hosts: list[str]) -> list[str]:
    """DeepSpeed's launcher invocation for these hosts (rank 0 runs on the first).

    :param arguments: launcher, ports, module and training arguments.
    :param hostfile: the hostfile DeepSpeed reads.
    :param hosts: its hosts, in node-rank order.
    :rtype: list[str]
    """
    master_addr = "127.0.0.1" if arguments.launcher == "local" else arguments.master_addr or hosts[0]
    command = [_deepspeed_executable(), "--hostfile", str(hostfile)]
    if arguments.launcher == "pdsh":
        command += ["--launcher", "pdsh"]
        if arguments.ssh_port is not None:
            command += ["--ssh_port", str(arguments.ssh_port)]
    command += [
        "--master_addr",
        master_addr,
        "--master_port",
        str(arguments.master_port or _default_master_port(master_addr)),
    ]
    # Our own check ran with the run's ssh config; DeepSpeed's plain `ssh host hostname` would not use it.
    command += ["--no_ssh_check", "--no_local_rank", "--module", arguments.module]
    return command + arguments.train_args


def rank_environment(arguments: LaunchArguments, hosts: list[str], launch_id: str) -> dict[str, str]:
    """The variables every rank gets (``$VAR`` in a value expands on the rank's host).

    :param arguments: socket interface and extra variables.
    :param hosts: the hosts (all loopback: NCCL and gloo use ``lo``).
    :param launch_id: this launch's marker value.
    :rtype: dict[str, str]
    """
    env = {
        LAUNCH_ID_VAR: launch_id,
        "PYTHONPATH": str(PROJECT_DIR),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}$PATH",
    }
    env |= {name: os.environ[name] for name in CARRIED_VARS if os.environ.get(name)}
    # Each worker's sshd sets the interface its agent reported (worker/agent.py); --socket-ifname overrides
    # them all, and loopback hosts without an agent (ssh sessions without the variables) fall back to lo.
    if arguments.socket_ifname:
        env |= dict.fromkeys(SOCKET_IFNAME_VARS, arguments.socket_ifname)
    elif all(_is_loopback(host) for host in hosts):
        env |= {name: "lo" if arguments.launcher == "local" else f"${{{name}:-lo}}" for name in SOCKET_IFNAME_VARS}
    return env | arguments.env


def check_env_entry(key: str, value: str) -> None:
    """Refuse a rank variable that is no shell name, looks like a credential, or would break the export.

    :param key: the variable's name.
    :param value: its value.
    :raises LaunchError: naming the ``--env`` to change.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise LaunchError(f"environment name {key!r} is not a shell variable name; pass --env NAME=VALUE")
    if SECRET_NAME.search(key):
        raise LaunchError(
            f"{key!r} looks like a secret, and .deepspeed_env ends up on pdsh's command line and in launch.log; "
            "give ranks credentials through the hosts' own environment or files"
        )
    if URL_PASSWORD.search(value):
        raise LaunchError(
            f"the value of {key} holds a password in a URL, and .deepspeed_env ends up on pdsh's command line "
            "and in launch.log; give ranks credentials through the hosts' own environment or files"
        )
    if re.search(r'["`\\\n]', value):
        raise LaunchError(f"value of {key} ({value!r}) has a quote, backslash or newline; pass a plain value")


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the variables that hold credentials, by name or by value (a URL with a password).

    :param environ: an environment (the launching process's).
    :rtype: dict[str, str]
    """
    kept = {}
    for key, value in environ.items():
        if SECRET_NAME.search(key):
            continue
        if URL_PASSWORD.search(value):
            logger.warning(
                "%s holds a password in a URL: not passed to DeepSpeed's runner, whose command line "
                "shows it; give ranks credentials through the hosts' own environment or files",
                key,
            )
            continue
        kept[key] = value
    return kept


def mask_credentials(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``, for logs and terminals.

    Usage::

        >>> mask_credentials("proxy http://alice:hunter2@proxy:3128 used")
        'proxy http://alice:***@proxy:3128 used'

    :rtype: str
    """
    return URL_PASSWORD.sub(rf"\1:{MASK}@", text)


def write_deepspeed_env(path: Path, env: dict[str, str]) -> Path:
    """Write ``KEY=VAL`` lines where DeepSpeed's runner reads them (``DS_ENV_FILE``).

    :param path: the run's ``.deepspeed_env``.
    :param env: the ranks' variables, checked by :func:`check_env_entry`.
    :rtype: Path
    """
    # DeepSpeed's runner splits each line at the first '=' and fails on anything else: no blank lines.
    return atomic_write(path, "".join(f"{key}={value}\n" for key, value in env.items()))


def local_device_count() -> int:
    """The devices DeepSpeed's accelerator sees here (its default rank count for ``--launcher local``).

    :rtype: int
    """
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_count()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_master_port(master_addr: str) -> int:
    # Local worker pods share this machine with other runs and test sessions: a fixed port collides.
    if not _is_loopback(master_addr):
        return DEFAULT_MASTER_PORT
    return free_port(master_addr)


def _deepspeed_executable() -> str:
    # The launcher of this interpreter's environment, so a notebook kernel's venv is the one used.
    beside = Path(sys.executable).parent / "deepspeed"
    found = str(beside) if beside.is_file() else shutil.which("deepspeed")
    if found is None:
        raise LaunchError("DeepSpeed's `deepspeed` launcher is not installed; run `make setup`")
    return found
