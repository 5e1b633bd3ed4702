"""Run the training module on every rank through DeepSpeed's own launcher.

``deepspeed --hostfile H --launcher pdsh --master_addr A --master_port M --no_ssh_check
--no_local_rank --module textsql.train ARGS`` for the hosts of a run (pdsh over ssh, with the run's
ssh_config: per-run identity, host keys verified against the run's known_hosts), or
``--launcher local`` for the ranks of one machine. What this module adds to DeepSpeed's runner:

- checks before anything starts: pdsh installed, each host reachable with the run's ssh config,
  host keys verified (DeepSpeed's own reachability check ignores ``PDSH_SSH_ARGS_APPEND``, so it is
  replaced by ours and switched off with ``--no_ssh_check``);
- the ranks' environment in the run's ``.deepspeed_env`` (found through ``DS_ENV_FILE``), no secrets;
- the output streamed live (pdsh prefixes each line with ``host: ``) and appended to ``launch.log``;
- the exit code of the first host whose ranks failed, and the other hosts' ranks ended at once
  (a rank that dies before the process group forms would otherwise leave the rest waiting for
  torch's 30-minute rendezvous timeout);
- on KeyboardInterrupt or SIGTERM, every rank of this launch ended on every host. Processes are
  found by a per-launch marker in their environment, not by name: DeepSpeed's own interrupt handler
  runs ``pkill -f`` on a command-line pattern that matches every DeepSpeed launch of the same
  interpreter on the host, other users' included, so its runner is never sent SIGINT/SIGTERM here.

Usage::

    >>> from textsql.launch import LaunchArguments, launch
    >>> launch(LaunchArguments(run_dir="runs/r1", train_args=["--output_dir", "runs/r1/out"]))
    0
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from textsql.constants import DEEPSPEED_ENV_NAME, DEFAULT_MASTER_PORT, DSCONFIG_DIR_VAR, LAUNCH_LOG_NAME, PROJECT_DIR
from textsql.errors import LaunchError
from worker.constants import HOSTFILE_NAME, SSH_CONFIG_NAME
from worker.hostfile import read_hostfile, write_hostfile

logger = logging.getLogger(__name__)

LAUNCHERS = ("pdsh", "local")
TRAIN_MODULE = "textsql.train"
# Every process of one launch carries this variable (value: a fresh random id), so its ranks can be
# found and ended on any host without matching other people's processes by name.
LAUNCH_ID_VAR = "TEXTSQL_LAUNCH_ID"
LOCAL_HOSTFILE_NAME = "hostfile.local"
SSH_CHECK_TIMEOUT_S = 20.0
# How long ranks get to exit after SIGTERM before SIGKILL, and how long the runner then gets.
END_GRACE_S = 10.0
RUNNER_EXIT_S = 20.0
# Variables a rank inherits from the launching environment when set there. Caches are carried only
# when set: unset, each host keeps its own default (torch's default extensions dir is
# ~/.cache/torch_extensions/py311_cpu, not the root it would get if set to the default root).
CARRIED_VARS = (
    "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TORCH_EXTENSIONS_DIR",
    "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR", DSCONFIG_DIR_VAR,
)
# Names that hold credentials: never written to .deepspeed_env (it ends up on pdsh's command line and
# in the log) and kept from DeepSpeed's runner, which exports every MLFLOW*/PYTHON*/... variable.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY", re.IGNORECASE)
# What pdsh prints when the command on one host ended with a non-zero status.
PDSH_HOST_FAILED = re.compile(r"^pdsh@[^:]+: (?P<host>\S+): ssh exited with exit code (?P<code>\d+)")
# Characters that reach a rank unchanged through pdsh (which fills in %h, %n, %u) and the hosts' shell
# (DeepSpeed double-quotes an argument with spaces).
SHELL_SAFE = re.compile(r"[\w@+=:,./ -]+")

# Run by the interpreter on each host (stdlib only; the same path DeepSpeed's launch runs there):
# SIGTERM every process whose environment holds the launch's marker, SIGKILL what is left after grace.
_END_RANKS_SCRIPT = r"""
import os, signal, sys, time
entry, grace = sys.argv[1].encode(), float(sys.argv[2])
def marked():
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as environ:
                    if entry in environ.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                pass
    return found
def send(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
pids = marked()
send(pids, signal.SIGTERM)
deadline = time.monotonic() + grace
while pids and time.monotonic() < deadline:
    time.sleep(0.2)
    pids = marked()
send(pids, signal.SIGKILL)
"""


@dataclass
class LaunchArguments:
    """Where and how to run the training module on every rank."""

    run_dir: Path = field(
        metadata={"help": "Run directory: the workers' hostfile, ssh_config and known_hosts; launch.log and .deepspeed_env are written here."}
    )
    train_args: list[str] = field(
        default_factory=list, metadata={"help": "Arguments for the training module (see `textsql train --help`)."}
    )
    launcher: str = field(
        default="pdsh", metadata={"help": "pdsh: the hosts of the hostfile over ssh; local: this machine only, no ssh.", "choices": LAUNCHERS}
    )
    hostfile: Path | None = field(default=None, metadata={"help": "DeepSpeed hostfile (default: RUN_DIR/hostfile)."})
    ssh_config: Path | None = field(
        default=None, metadata={"help": "ssh_config for every host (default: RUN_DIR/ssh_config if present, else your own ssh setup)."}
    )
    ssh_port: int | None = field(default=None, metadata={"help": "sshd port of every host, when ssh_config does not give it."})
    master_addr: str | None = field(default=None, metadata={"help": "Address ranks reach rank 0 at (default: the first host)."})
    master_port: int | None = field(
        default=None,
        metadata={"help": f"Port of torch.distributed's store on the first host (default: {DEFAULT_MASTER_PORT}; a free one when that host is this machine)."},
    )
    ranks: int | None = field(
        default=None, metadata={"help": "--launcher local: ranks on this machine (default: DeepSpeed's device count)."}
    )
    socket_ifname: str | None = field(
        default=None, metadata={"help": "Network interface for NCCL and gloo (default: lo when every host is a loopback address)."}
    )
    env: dict[str, str] = field(default_factory=dict, metadata={"help": "Extra KEY=VAL for every rank (no secrets)."})
    module: str = field(default=TRAIN_MODULE, metadata={"help": "Python module each rank runs."})

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
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchError(f"--master-port {self.master_port!r} is not a TCP port; pass one from 1 to 65535")
        if not re.fullmatch(r"\w+(\.\w+)*", self.module):
            raise LaunchError(f"--module {self.module!r} is not a Python module name; pass one like {TRAIN_MODULE}")
        for key, value in self.env.items():
            _check_env_entry(key, value)
        if self.launcher == "pdsh":
            for arg in self.train_args:
                if not SHELL_SAFE.fullmatch(arg):
                    raise LaunchError(
                        f"training argument {arg!r} has characters the hosts' shell would interpret; "
                        "put such values in a file and pass its path"
                    )


def launch(arguments: LaunchArguments, stream: TextIO | None = None) -> int:
    """Run ``arguments.module`` on every rank through DeepSpeed's launcher and wait for it.

    :param arguments: hosts, ssh settings and the training arguments.
    :param stream: where the ranks' output goes live (default: sys.stdout); it is also appended to
        RUN_DIR/launch.log.
    :rtype: int
    :returns: 0, or the exit code of the first host whose ranks failed.
    :raises LaunchError: if pdsh, ssh or the hostfile is not ready (the message says what to fix).
    :raises KeyboardInterrupt: on interrupt or SIGTERM, after every rank of the launch has ended.
    """
    run_dir = arguments.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_id = secrets.token_hex(8)
    prepare = _prepare_pdsh if arguments.launcher == "pdsh" else _prepare_local
    hostfile, hosts, env, ranks = prepare(arguments, run_dir, launch_id)
    command = deepspeed_command(arguments, hostfile, hosts)
    logger.info("cmd = %s", shlex.join(command))
    with open(run_dir / LAUNCH_LOG_NAME, "a", encoding="utf-8") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} launch {launch_id}: {shlex.join(command)}\n")
        return _run(command, env, ranks, stream or sys.stdout, log)


def _prepare_pdsh(arguments: LaunchArguments, run_dir: Path, launch_id: str):
    """Check pdsh and ssh to every host, write .deepspeed_env; the runner's environment."""
    hostfile = (arguments.hostfile or run_dir / HOSTFILE_NAME).resolve()
    hosts = list(read_hostfile(hostfile))
    ssh = _SSH.for_run(arguments, run_dir)
    ssh.check(hosts)
    env_file = _write_deepspeed_env(run_dir / DEEPSPEED_ENV_NAME, rank_environment(arguments, hosts, launch_id))
    # pdsh's command line shows in `ps` and the runner exports PYTHON*/MLFLOW*/... variables on it,
    # so credentials stay out of the runner's environment.
    env = {key: value for key, value in os.environ.items() if not SECRET_NAME.search(key)}
    env |= {"DS_ENV_FILE": str(env_file), "PDSH_SSH_ARGS_APPEND": shlex.join(ssh.options)}
    return hostfile, hosts, env, _RemoteRanks(ssh, hosts, launch_id)


def _prepare_local(arguments: LaunchArguments, run_dir: Path, launch_id: str):
    """A ``localhost slots=N`` hostfile; the ranks' variables go straight into the runner's environment."""
    hostfile = write_hostfile(run_dir / LOCAL_HOSTFILE_NAME, [("localhost", arguments.ranks or _local_device_count())])
    hosts = ["localhost"]
    # No shell between the runner and the ranks here: expand $VAR as the hosts' shell would.
    rank_env = rank_environment(arguments, hosts, launch_id)
    env = os.environ | {key: string.Template(value).safe_substitute(os.environ) for key, value in rank_env.items()}
    return hostfile, hosts, env, _LocalRanks(launch_id)


def parse_env(entries: Iterable[str]) -> dict[str, str]:
    """``{KEY: VALUE}`` from ``KEY=VALUE`` strings (the CLI's repeated ``--env``).

    :param entries: the strings.
    :rtype: dict[str, str]
    :raises LaunchError: on an entry without ``=``.
    """
    env = {}
    for entry in entries:
        key, equals, value = entry.partition("=")
        if not equals:
            raise LaunchError(f"--env {entry!r} has no '='; pass --env KEY=VALUE")
        env[key] = value
    return env


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
    command += ["--master_addr", master_addr, "--master_port", str(arguments.master_port or _default_master_port(master_addr))]
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
    ifname = arguments.socket_ifname or ("lo" if all(_is_loopback(host) for host in hosts) else None)
    if ifname:
        env |= {"NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname}
    return env | arguments.env


@dataclass(frozen=True)
class _SSH:
    """ssh as pdsh will run it for this launch: the run's config, never a prompt."""

    options: tuple[str, ...]

    @classmethod
    def for_run(cls, arguments: LaunchArguments, run_dir: Path) -> "_SSH":
        if shutil.which("pdsh") is None:
            raise LaunchError("pdsh is not installed; run `make setup` (Debian package pdsh) or pass --launcher local")
        if shutil.which("ssh") is None:
            raise LaunchError("ssh is not installed; run `make setup` (Debian package openssh-client)")
        config = arguments.ssh_config or run_dir / SSH_CONFIG_NAME
        options: tuple[str, ...] = ("-o", "BatchMode=yes")
        if config.is_file():
            if re.search(r"\s", str(config.resolve())):
                raise LaunchError(f"ssh config path {str(config.resolve())!r} has whitespace, which pdsh splits; use a run dir without spaces")
            options = ("-F", str(config.resolve())) + options
        elif arguments.ssh_config is not None:
            raise LaunchError(f"ssh config {str(config)!r} does not exist; start the workers first or pass --ssh-config")
        else:
            logger.info("no %s in %s: ssh uses your own configuration", SSH_CONFIG_NAME, run_dir)
        if arguments.ssh_port is not None:
            options += ("-p", str(arguments.ssh_port))
        return cls(options)

    def command(self, host: str, *remote: str) -> list[str]:
        return ["ssh", *self.options, host, *remote]

    def check(self, hosts: list[str]) -> None:
        """Raise LaunchError unless every host verifies its host key and accepts the key without a password."""
        for host in hosts:
            checking = _ssh_setting(self.options, host, "stricthostkeychecking")
            if checking not in ("true", "ask"):
                raise LaunchError(
                    f"ssh to {host!r} would not verify its host key (StrictHostKeyChecking {checking}); "
                    "use the run's ssh_config, which pins the workers' keys from the rendezvous"
                )
        checks = {
            host: subprocess.Popen(self.command(host, "true"), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
                f"passwordless ssh failed for {', '.join(failed)} with `{shlex.join(self.command('HOST', 'true'))}`; "
                "check that the workers are running and the run's ssh_config/known_hosts are theirs"
            )


class _RemoteRanks:
    """The ranks of one launch on the hosts, ended over ssh."""

    def __init__(self, ssh: _SSH, hosts: list[str], launch_id: str) -> None:
        self.ssh, self.hosts, self.entry = ssh, hosts, f"{LAUNCH_ID_VAR}={launch_id}"

    def end(self) -> None:
        remote = f"{shlex.quote(sys.executable)} - {self.entry} {END_GRACE_S}"
        enders = [
            subprocess.Popen(self.ssh.command(host, remote), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for host in self.hosts
        ]
        for host, ender in zip(self.hosts, enders):
            try:
                _, error = ender.communicate(_END_RANKS_SCRIPT, timeout=END_GRACE_S + SSH_CHECK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                ender.kill()
                _, error = ender.communicate()
            if ender.returncode != 0:
                logger.warning("could not end the ranks on %s: %s", host, error.strip() or f"exit code {ender.returncode}")


class _LocalRanks:
    """The ranks of one launch on this machine."""

    def __init__(self, launch_id: str) -> None:
        self.entry = f"{LAUNCH_ID_VAR}={launch_id}"

    def end(self) -> None:
        subprocess.run([sys.executable, "-c", _END_RANKS_SCRIPT, self.entry, str(END_GRACE_S)], check=False)


def _run(command: list[str], env: dict[str, str], ranks: _RemoteRanks | _LocalRanks, stream: TextIO, log: TextIO) -> int:
    """Run the launcher, tee its output, end every rank once one host fails or on interrupt."""
    started = time.monotonic()
    first_failure: tuple[str, int] | None = None
    # A session of its own: a terminal's Ctrl-C reaches only us, never DeepSpeed's runner (whose
    # SIGINT handler would pkill by pattern on every host).
    runner = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", bufsize=1, start_new_session=True,
    )
    try:
        with _sigterm_as_interrupt():
            for line in runner.stdout:
                # The log first: a line someone has seen is in launch.log even if they interrupt at once.
                log.write(line)
                stream.write(line)
                stream.flush()
                failed = PDSH_HOST_FAILED.match(line)
                if failed and int(failed["code"]) != 0 and first_failure is None:
                    first_failure = failed["host"], int(failed["code"])
                    logger.error("ranks on %s failed with exit code %d; ending the other hosts' ranks", *first_failure)
                    ranks.end()
            runner.wait()
    except BaseException as error:
        logger.warning("%s: ending every rank of this launch", type(error).__name__)
        ranks.end()
        _stop_runner(runner)
        raise
    finally:
        log.flush()
    code = first_failure[1] if first_failure else runner.returncode
    if code != 0 and first_failure is None:
        ranks.end()
    elapsed = time.monotonic() - started
    logger.info("launch ended after %.1f s with exit code %d", elapsed, code)
    log.write(f"# exit code {code} after {elapsed:.1f} s\n")
    return code


def _stop_runner(runner: subprocess.Popen) -> None:
    # Its ranks are gone, so pdsh and the runner end by themselves; SIGKILL (never SIGTERM, see the
    # module docstring) whatever of it is still there after that, ssh clients in their own sessions too.
    try:
        runner.wait(timeout=RUNNER_EXIT_S)
        return
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [*psutil.Process(runner.pid).children(recursive=True), psutil.Process(runner.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    runner.wait()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (a stopped job, `kill`) into KeyboardInterrupt so the ranks are ended too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_env_entry(key: str, value: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise LaunchError(f"environment name {key!r} is not a shell variable name; pass --env NAME=VALUE")
    if SECRET_NAME.search(key):
        raise LaunchError(
            f"{key!r} looks like a secret, and .deepspeed_env ends up on pdsh's command line and in launch.log; "
            "give ranks credentials through the hosts' own environment or files"
        )
    if re.search(r'["`\\\n]', value):
        raise LaunchError(f"value of {key} ({value!r}) has a quote, backslash or newline; pass a plain value")


def _write_deepspeed_env(path: Path, env: dict[str, str]) -> Path:
    # DeepSpeed's runner splits each line at the first '=' and fails on anything else: no blank lines.
    text = "".join(f"{key}={value}\n" for key, value in env.items())
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)
    return path


def _ssh_setting(options: tuple[str, ...], host: str, name: str) -> str:
    """The value ssh would use for one setting when connecting to host (``ssh -G``: no connection)."""
    result = subprocess.run(["ssh", "-G", *options, host], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LaunchError(f"ssh cannot read its configuration for {host!r}: {result.stderr.strip()}; fix the ssh_config")
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return value
    return ""


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
    with socket.socket() as probe:
        probe.bind((master_addr, 0))
        return probe.getsockname()[1]


def _local_device_count() -> int:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_count()


def _deepspeed_executable() -> str:
    # The launcher of this interpreter's environment, so a notebook kernel's venv is the one used.
    beside = Path(sys.executable).parent / "deepspeed"
    found = str(beside) if beside.is_file() else shutil.which("deepspeed")
    if found is None:
        raise LaunchError("DeepSpeed's `deepspeed` launcher is not installed; run `make setup`")
    return found
