"""What a launch is given (:class:`LaunchArguments`), DeepSpeed's launcher command for it, and the environment its ranks get.

``deepspeed --hostfile H --launcher pdsh --master_addr A --master_port M --no_ssh_check
--force_multi --no_local_rank --module textsql.training.train ARGS``; for the ranks of one machine, the per-node launcher that
command would run here, ``python -u -m deepspeed.launcher.launch --world_info=... ARGS`` (see :func:`local_command`).
Either is started through :mod:`textsql.launching.deepspeed_entry` (``python -u -m textsql.launching.deepspeed_entry
deepspeed.launcher.runner ARGS``): DeepSpeed's own program, by this interpreter, without MLflow.
The ranks' variables go to the run's ``.deepspeed_env`` (DeepSpeed's runner finds it through
``DS_ENV_FILE`` and exports each ``KEY=VAL`` line on pdsh's command line), so no credential may be
among them: names that look like one are refused here, and kept from the runner's own environment.

Usage::

    >>> command = deepspeed_command(arguments, run_dir / "hostfile", ["127.0.0.2", "127.0.0.3"])
    >>> write_deepspeed_env(run_dir / ".deepspeed_env", rank_environment(arguments, hosts, launch_id))
"""

from __future__ import annotations

import base64
import importlib.util
import ipaddress
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from textsql.constants import DSCONFIG_DIR_VAR, PROJECT_DIR, TRACKING_PREFIX
from textsql.errors import LaunchError
from textsql.launching.deepspeed_entry import ENTRY_MODULE, NODE_LAUNCHER, RUNNER
from textsql.rank_lines import LAUNCH_ID_VAR, RUN_MARK_VAR, run_mark
from textsql.sanitize import has_url_password
from worker.constants import SOCKET_IFNAME_VARS
from worker.files import atomic_write
from worker.network import free_port

logger = logging.getLogger(__name__)

# torch.distributed's store on the first host: DeepSpeed's default port.
DEFAULT_MASTER_PORT = 29500

# Variables a rank inherits from the launching environment when set there. Caches are carried only
# when set: unset, each host keeps its own default (torch's default extensions dir is
# ~/.cache/torch_extensions/py311_cpu, not the root it would get if set to the default root).
CARRIED_VARS = (
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TORCH_EXTENSIONS_DIR",
    "TORCHINDUCTOR_CACHE_DIR",  # torch.compile's cache (textsql.training.compiling)
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "DS_ACCELERATOR",
    DSCONFIG_DIR_VAR,
)
# Names that hold credentials: never written to .deepspeed_env (it ends up on pdsh's command line and
# in the log) and kept from DeepSpeed's runner, which exports every MLFLOW*/PYTHON*/... variable.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY", re.IGNORECASE)
# DeepSpeed's runner puts each .deepspeed_env value in double quotes on the remote shell's command line,
# where only `$`, backquotes, backslashes and double quotes act: a value holds none of the last three,
# and a `$` only as a plain variable reference ($NAME or ${NAME}), never $(...), $((...)) or ${NAME:-...}.
_EXPANSION = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")
# A network interface name as NCCL and gloo read it: optional ^ (exclude) and = (exact), then names
# (Linux allows 15 characters) separated by commas.
_IFNAMES = re.compile(r"\^?=?[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*")
# A DNS hostname, for a --master_addr that is not an IP address.
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
# Characters that reach a rank unchanged through pdsh (which fills in %h, %n, %u) and the hosts' shell
# (DeepSpeed double-quotes an argument with spaces).
SHELL_SAFE = re.compile(r"[\w@+=:,./ -]+")
LAUNCHERS = ("pdsh", "local")
TRAIN_MODULE = "textsql.training.train"


@dataclass
class LaunchArguments:
    """Where and how to run the training module on every rank."""

    run_dir: Path = field(
        metadata={
            "help": "Run directory, the ranks' too (their checkpoints, model/, run.json, tensorboard/); launch.log is "
            "written here."
        }
    )
    train_args: list[str] = field(
        default_factory=list, metadata={"help": "Arguments for the training module (see `textsql train --help`)."}
    )
    launcher: str = field(
        default="pdsh",
        metadata={
            "help": "pdsh: the hosts of the hostfile over ssh; local: this machine only, no ssh.",
            "choices": LAUNCHERS,
        },
    )
    hostfile: Path | None = field(default=None, metadata={"help": "DeepSpeed hostfile (default: RUN_DIR/hostfile)."})
    ssh_config: Path | None = field(
        default=None,
        metadata={"help": "ssh_config for every host (default: your own ssh setup; RUN_DIR/ssh_config is never read)."},
    )
    ssh_port: int | None = field(
        default=None, metadata={"help": "sshd port of every host, when ssh_config does not give it."}
    )
    master_addr: str | None = field(
        default=None, metadata={"help": "Address ranks reach rank 0 at (default: the first host)."}
    )
    master_port: int | None = field(
        default=None,
        metadata={
            "help": f"Port of torch.distributed's store on the first host (default: {DEFAULT_MASTER_PORT}; a free one when that host is this machine)."
        },
    )
    ranks: int | None = field(
        default=None, metadata={"help": "--launcher local: ranks on this machine (default: DeepSpeed's device count)."}
    )
    socket_ifname: str | None = field(
        default=None,
        metadata={
            "help": "Network interface for NCCL and gloo on every host (default: the one each worker reported; lo for loopback hosts)."
        },
    )
    env: dict[str, str] = field(default_factory=dict, metadata={"help": "Extra KEY=VAL for every rank (no secrets)."})
    module: str = field(default=TRAIN_MODULE, metadata={"help": "Python module each rank runs."})
    checkpoint_store: str | None = field(
        default=None,
        metadata={
            "help": "fsspec URI (s3://BUCKET/PREFIX, gs://, abfs://, file://) every complete checkpoint and the "
            "model are copied to; with --resume-from-checkpoint auto an empty run directory resumes from it. Credentials from "
            "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)."
        },
    )

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.hostfile = Path(self.hostfile) if self.hostfile is not None else None
        self.ssh_config = Path(self.ssh_config) if self.ssh_config is not None else None
        self.train_args = [str(arg) for arg in self.train_args]
        if self.launcher not in LAUNCHERS:
            raise LaunchError(f"unknown launcher {self.launcher!r}; pass --launcher {' or '.join(LAUNCHERS)}")
        if self.launcher == "pdsh" and self.ranks is not None:
            raise LaunchError("--ranks is for --launcher local; with pdsh the hostfile's slots say how many ranks run")
        if self.ranks is not None and self.ranks < 1:
            raise LaunchError(f"--ranks {self.ranks!r} must be at least 1")
        for flag, port in (("--master-port", self.master_port), ("--ssh-port", self.ssh_port)):
            if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
                raise LaunchError(f"{flag} {port!r} is not a TCP port; pass one from 1 to 65535")
        if self.master_addr is not None:
            self.master_addr = check_master_addr(self.master_addr)
        if self.socket_ifname is not None:
            self.socket_ifname = check_socket_ifname(self.socket_ifname)
        if not re.fullmatch(r"\w+(\.\w+)*", self.module):
            raise LaunchError(f"--module {self.module!r} is not a Python module name; pass one like {TRAIN_MODULE}")
        for key, value in self.env.items():
            check_env_entry(key, value)
        if self.launcher == "pdsh":
            for arg in self.train_args:
                if not SHELL_SAFE.fullmatch(arg):
                    raise LaunchError(
                        f"training argument {arg!r} has characters the hosts' shell would interpret; "
                        "put such values in a file and pass its path"
                    )


def deepspeed_command(arguments: LaunchArguments, hostfile: Path, hosts: list[str]) -> list[str]:
    """DeepSpeed's runner invocation for these hosts over pdsh (rank 0 runs on the first).

    :param arguments: ports, module and training arguments.
    :param hostfile: the hostfile DeepSpeed reads.
    :param hosts: its hosts, in node-rank order.
    :rtype: list[str]
    """
    master_addr = arguments.master_addr or hosts[0]
    command = [*_deepspeed_program(RUNNER), "--hostfile", str(hostfile), "--launcher", "pdsh"]
    if arguments.ssh_port is not None:
        command += ["--ssh_port", str(arguments.ssh_port)]
    command += [
        "--master_addr",
        master_addr,
        "--master_port",
        str(arguments.master_port or _default_master_port(master_addr)),
    ]
    # Our own check ran with the run's ssh config; DeepSpeed's plain `ssh host hostname` would not use it.
    # --force_multi: with one host (a run gone on with one worker) the runner would start the ranks on this machine.
    command += ["--no_ssh_check", "--force_multi", "--no_local_rank", "--module", arguments.module]
    return command + arguments.train_args


def local_command(arguments: LaunchArguments, ranks: int) -> list[str]:
    """DeepSpeed's per-node launcher for ``ranks`` ranks on this machine, as its runner would start it.

    For one machine DeepSpeed's runner (``deepspeed --hostfile ...``) only turns its hostfile into this
    command line and runs it; starting it here saves that process its ~2 s of importing torch before the
    ranks start.

    :param arguments: port, module and training arguments.
    :param ranks: the ranks to start (their device ids are 0..ranks-1).
    :rtype: list[str]
    """
    # The runner's encode_world_info: {host: [device ids]} as URL-safe base64 JSON.
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()
    master_port = arguments.master_port or _default_master_port("127.0.0.1")
    return [
        *_deepspeed_program(NODE_LAUNCHER),
        f"--world_info={world_info}",
        "--master_addr=127.0.0.1",
        f"--master_port={master_port}",
        "--module",
        "--no_local_rank",
        arguments.module,
        *arguments.train_args,
    ]


def rank_environment(arguments: LaunchArguments, hosts: list[str], launch_id: str) -> dict[str, str]:
    """The variables every rank gets (``$VAR`` in a value expands on the rank's host).

    :param arguments: socket interface and extra variables.
    :param hosts: the hosts (all loopback: NCCL and gloo use ``lo``).
    :param launch_id: this launch's marker value.
    :rtype: dict[str, str]
    """
    env = {
        LAUNCH_ID_VAR: launch_id,
        RUN_MARK_VAR: run_mark(arguments.run_dir),
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
    if has_url_password(value):
        raise LaunchError(
            f"the value of {key} holds a password in a URL, and .deepspeed_env ends up on pdsh's command line "
            "and in launch.log; give ranks credentials through the hosts' own environment or files"
        )
    if key.startswith(TRACKING_PREFIX):
        raise LaunchError(
            f"{key!r} goes on pdsh's command line from .deepspeed_env; set it in the launching environment "
            "instead: MLflow's variables reach the logging rank in a 0600 file (textsql.launching.tracking_env)"
        )
    if re.search(r'["`\\\n\r\0]', value):
        raise LaunchError(f"value of {key} ({value!r}) has a quote, backslash or newline; pass a plain value")
    if "$" in _EXPANSION.sub("", value):
        raise LaunchError(
            f"value of {key} ({value!r}) has a $ that is not a plain $NAME: the hosts' shell would run it; "
            "pass a plain value"
        )


def check_socket_ifname(value: str) -> str:
    """An interface name (or NCCL's ``^``/``=``, comma-separated list) that reaches the ranks as written.

    :param value: ``--socket-ifname``.
    :rtype: str
    :raises LaunchError: naming the flag.
    """
    if not _IFNAMES.fullmatch(value):
        raise LaunchError(
            f"--socket-ifname {value!r} is not a network interface name (letters, digits, '_.:-', up to 15); "
            "pass one that `ip link` lists, such as eth0"
        )
    return value


def check_master_addr(value: str) -> str:
    """An IP address or DNS hostname for rank 0, which reaches every host's shell unquoted.

    :param value: ``--master-addr``.
    :rtype: str
    :raises LaunchError: naming the flag.
    """
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        if _HOSTNAME.fullmatch(value):
            return value
    raise LaunchError(f"--master-addr {value!r} is not an IP address or hostname; pass the first host's address")


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the variables that hold credentials, by name or by value (a URL with a password).

    :param environ: an environment (the launching process's).
    :rtype: dict[str, str]
    """
    kept = {}
    for key, value in environ.items():
        if SECRET_NAME.search(key):
            continue
        if has_url_password(value):
            logger.warning(
                "%s holds a password in a URL: not passed to DeepSpeed's runner, whose command line "
                "shows it; give ranks credentials through the hosts' own environment or files",
                key,
            )
            continue
        kept[key] = value
    return kept


def write_deepspeed_env(path: Path, env: dict[str, str]) -> Path:
    """Write ``KEY=VAL`` lines where DeepSpeed's runner reads them (``DS_ENV_FILE``).

    :param path: the run's ``.deepspeed_env``.
    :param env: the ranks' variables, checked by :func:`check_env_entry`.
    :rtype: Path
    """
    # DeepSpeed's runner splits each line at the first '=' and fails on anything else: no blank lines.
    return atomic_write(path, "".join(f"{key}={value}\n" for key, value in env.items()), mode=0o600)


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


def _deepspeed_program(program: str) -> list[str]:
    # DeepSpeed of this interpreter's environment (a notebook kernel's venv), started without MLflow.
    if importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(f"DeepSpeed is not installed for {sys.executable}; run `make setup`")
    return [sys.executable, "-u", "-m", ENTRY_MODULE, program]
