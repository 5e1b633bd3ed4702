"""Run the training module on every rank through DeepSpeed's own launcher, and watch it to the end.

``deepspeed --launcher pdsh`` for the hosts of a run (over ssh with the run's ssh_config: per-run
identity, host keys verified against the run's known_hosts), or ``--launcher local`` for the ranks
of one machine (DeepSpeed's per-node launcher, ``deepspeed.launcher.launch``, started directly). This module puts the steps together; each lives in its own module:

- :mod:`textsql.launching.preflight`: pdsh installed, each host reachable with its host key verified, before
  anything starts;
- :mod:`textsql.launching.command`: the ``deepspeed`` command and the ranks' environment in the run's
  ``.deepspeed_env`` (found through ``DS_ENV_FILE``), no secrets;
- :mod:`textsql.launching.ranks`: finding and ending a launch's processes by a per-launch marker.

What this module adds to DeepSpeed's runner:

- the output appended to ``launch.log`` and streamed live (pdsh prefixes each line with ``host: ``),
  at the default log level only the lines :func:`textsql.console.shown_rank_line` picks;
- the output read as bytes and cut into lines at ``\n`` alone, the one place pdsh starts a new prefixed line:
  a rank controls all its text after ``host: `` (a ``\r``, a line separator, invalid UTF-8), and none of it
  may start a line of its own. A line ends at its first NUL, as pdsh prints it (with ``%s``), so no reader
  sees more of it than pdsh shows; where pdsh glued the next line onto it, readers cut there
  (:func:`textsql.rank_lines.split_host_prefix`). pdsh's own messages (``pdsh@master: host: ssh exited with exit code N``) are
  read only from pdsh's stderr, a pipe of their own, where every rank line still carries its prefix;
- the exit code of the first host whose ranks failed, and the other hosts' ranks ended at once
  (a rank that dies before the process group forms would otherwise leave the rest waiting for
  torch's 30-minute rendezvous timeout);
- every rank ended on every host as soon as the caller's ``should_stop`` says so (the supervisor's stall
  detector, :mod:`textsql.launching.stall`), checked every :data:`STOP_POLL_S` seconds;
- on KeyboardInterrupt or SIGTERM, every rank of this launch ended on every host. DeepSpeed's own
  interrupt handler runs ``pkill -f`` on a command-line pattern that matches every DeepSpeed launch
  of the same interpreter on the host, other users' included, so its runner is never sent
  SIGINT/SIGTERM here.

Usage::

    >>> from textsql.launching.launch import LaunchArguments, launch
    >>> launch(LaunchArguments(run_dir="runs/r1", train_args=["--data-dir", "runs/data"]))
    0
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import secrets
import shlex
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import IO, NoReturn, TextIO

import psutil

from textsql.console import SanitizedLines, TextSink
from textsql.constants import LAUNCH_IDS_NAME, LAUNCH_LOG_NAME
from textsql.errors import LaunchError
from textsql.launching.command import (
    LaunchArguments,
    deepspeed_command,
    local_command,
    local_device_count,
    rank_environment,
    without_secrets,
    write_deepspeed_env,
)
from textsql.launching.preflight import preflight
from textsql.launching.ranks import LocalRanks, RemoteRanks
from textsql.launching.tracking_env import tracking_env, without_tracking
from textsql.launching.training_plan import TrainingPlan
from textsql.rundir.master_state import master_dir, record_launch_hosts
from textsql.sanitize import mask_credentials
from textsql.store.location import without_store_credentials
from worker.constants import HOSTFILE_NAME
from worker.files import private_opener
from worker.hostfile import read_hostfile

logger = logging.getLogger(__name__)

# The ranks' environment for DeepSpeed's runner, in the master-private directory (never the shared run directory).
DEEPSPEED_ENV_NAME = ".deepspeed_env"

# How long DeepSpeed's runner gets to exit once its ranks have ended.
RUNNER_EXIT_S = 20.0
# Seconds between two looks at the caller's should_stop.
STOP_POLL_S = 1.0
# What pdsh prints when the command on one host ended with a non-zero status.
PDSH_HOST_FAILED = re.compile(r"^pdsh@[^:]+: (?P<host>\S+): ssh exited with exit code (?P<code>\d+)")
# A line of the runner's output: whether it came on stderr (where pdsh's own messages are), and its text.
RunnerLine = tuple[bool, str]
# What preparing a launch gives its run: the launcher's command and environment, and the ranks to end.
Prepared = tuple[list[str], dict[str, str], RemoteRanks | LocalRanks]


def launch(
    arguments: LaunchArguments,
    plan: TrainingPlan | None = None,
    stream: TextSink | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> int:
    """Run ``arguments.module`` on every rank through DeepSpeed's launcher and wait for it.

    :param arguments: hosts, ssh settings and the training arguments.
    :param plan: the training arguments parsed (:meth:`TrainingPlan.read`; the supervisor hands each launch its
        own); None: parsed here, for a launch run without a supervisor.
    :param stream: where the ranks' output goes live (default: sys.stdout); it is also appended to
        RUN_DIR/launch.log.
    :param should_stop: called every second while the launch runs; once it returns True every rank is ended
        and the launch returns the runner's non-zero exit code.
    :rtype: int
    :returns: 0, or the exit code of the first host whose ranks failed.
    :raises LaunchError: if pdsh, ssh or the hostfile is not ready (the message says what to fix).
    :raises KeyboardInterrupt: on interrupt or SIGTERM, after every rank of the launch has ended.
    """
    if plan is None:
        plan = TrainingPlan.read(arguments)
        arguments = replace(arguments, train_args=list(plan.rank_args))
    run_dir = arguments.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_id = secrets.token_hex(8)
    prepare = _prepare_pdsh if arguments.launcher == "pdsh" else _prepare_local
    # MLflow's settings and credentials reach the logging rank in a 0600 file, never a command line.
    with tracking_env(arguments, plan) as tracked:
        command, env, ranks = prepare(tracked, run_dir, launch_id)
        record_launch(run_dir, launch_id)
        record_launch_hosts(run_dir, ranks.hosts if isinstance(ranks, RemoteRanks) else [])
        logger.info("cmd = %s", shlex.join(command))
        # Line-buffered: a kernel killed hard (it ends with os._exit once its parent is gone) keeps no lines unwritten.
        with open(run_dir / LAUNCH_LOG_NAME, "a", buffering=1, encoding="utf-8", opener=private_opener) as log:
            log.write(
                mask_credentials(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} launch {launch_id}: {shlex.join(command)}\n")
            )
            return _run(command, env, ranks, stream or SanitizedLines(sys.stdout), log, should_stop)


def record_launch(run_dir: Path, launch_id: str) -> None:
    """Add the launch's id to the run's record in its master-private directory, before the runner starts: a
    continuation after a hard kill ends the processes carrying it (:func:`textsql.pipeline.leftovers.launch_ids`).

    :param run_dir: the run directory.
    :param launch_id: the launch's id.
    """
    with open(master_dir(run_dir) / LAUNCH_IDS_NAME, "a", encoding="ascii", opener=private_opener) as record:
        record.write(launch_id + "\n")


def _prepare_pdsh(arguments: LaunchArguments, run_dir: Path, launch_id: str) -> Prepared:
    """Check pdsh and ssh to every host, write .deepspeed_env; the runner's environment."""
    hostfile = (arguments.hostfile or run_dir / HOSTFILE_NAME).resolve()
    hosts = list(read_hostfile(hostfile))
    options = preflight(hosts, run_dir, arguments.ssh_config, arguments.ssh_port)
    # In the master's own directory: DeepSpeed's runner reads the file again by its path, seconds after the check,
    # and puts each line into pdsh's remote command; in the run directory a worker could swap it in between.
    env_file = write_deepspeed_env(
        master_dir(run_dir) / DEEPSPEED_ENV_NAME, rank_environment(arguments, hosts, launch_id)
    )
    # pdsh's command line shows in `ps` and the runner exports PYTHON*/MLFLOW*/... variables on it,
    # so credentials and MLflow's settings stay out of the runner's environment.
    env = without_tracking(without_secrets(os.environ)) | {
        "DS_ENV_FILE": str(env_file),
        "PDSH_SSH_ARGS_APPEND": shlex.join(options),
    }
    return deepspeed_command(arguments, hostfile, hosts), env, RemoteRanks(options, hosts, launch_id)


def _prepare_local(arguments: LaunchArguments, run_dir: Path, launch_id: str) -> Prepared:
    """DeepSpeed's per-node launcher; the ranks' variables go straight into its environment."""
    # No shell between the launcher and the ranks here: expand $VAR as the hosts' shell would.
    rank_env = rank_environment(arguments, ["localhost"], launch_id)
    env = without_store_credentials(without_tracking(os.environ)) | {
        key: string.Template(value).safe_substitute(os.environ) for key, value in rank_env.items()
    }
    return local_command(arguments, arguments.ranks or local_device_count()), env, LocalRanks(launch_id)


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


def _run(
    command: list[str],
    env: dict[str, str],
    ranks: RemoteRanks | LocalRanks,
    stream: TextSink,
    log: TextIO,
    should_stop: Callable[[], bool] | None = None,
) -> int:
    """Run the launcher, tee its output, end every rank once one host fails, the caller says stop, or on interrupt."""
    started = time.monotonic()
    first_failure: tuple[str, int] | None = None
    # A session of its own: a terminal's Ctrl-C reaches only us, never DeepSpeed's runner (whose
    # SIGINT handler would pkill by pattern on every host).
    runner = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    ended = threading.Event()
    if should_stop is not None:
        # A stalled launch prints nothing, so the lines below never come: a thread of its own watches.
        threading.Thread(target=_stop_when, args=(should_stop, ranks, ended), name="launch-stop", daemon=True).start()
    try:
        with _sigterm_as_interrupt():
            for from_stderr, text in _lines(runner):
                line = mask_credentials(text) + "\n"
                # The log first: a line someone has seen is in launch.log even if they interrupt at once.
                log.write(line)
                stream.write(line)
                stream.flush()
                failed = PDSH_HOST_FAILED.match(text) if from_stderr else None
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
        ended.set()
        log.flush()
    code = first_failure[1] if first_failure else runner.returncode
    if code != 0 and first_failure is None:
        ranks.end()
    elapsed = time.monotonic() - started
    logger.info("launch ended after %.1f s with exit code %d", elapsed, code)
    log.write(f"# exit code {code} after {elapsed:.1f} s\n")
    return code


def _lines(runner: subprocess.Popen[bytes]) -> Iterator[RunnerLine]:
    """The runner's stdout and stderr lines as they come, each cut at ``\\n`` alone and decoded with replacement
    (see the module docstring); ends when both pipes are closed."""
    assert runner.stdout is not None and runner.stderr is not None  # both PIPE
    lines: queue.Queue[RunnerLine | None] = queue.Queue()
    for from_stderr, pipe in ((False, runner.stdout), (True, runner.stderr)):
        threading.Thread(target=_read_pipe, args=(pipe, from_stderr, lines), name="launch-output", daemon=True).start()
    open_pipes = 2
    while open_pipes:
        line = lines.get()
        if line is None:
            open_pipes -= 1
        else:
            yield line


def _read_pipe(pipe: IO[bytes], from_stderr: bool, lines: queue.Queue[RunnerLine | None]) -> None:
    with pipe:
        # A binary file's lines end at b"\n" only; a last line without one comes as it is.
        for raw in pipe:
            text = raw.removesuffix(b"\n").partition(b"\0")[0]
            lines.put((from_stderr, text.decode("utf-8", errors="replace")))
    lines.put(None)


def _stop_when(should_stop: Callable[[], bool], ranks: RemoteRanks | LocalRanks, ended: threading.Event) -> None:
    """End every rank once ``should_stop()`` is true; the runner and pdsh then exit by themselves."""
    while not ended.wait(STOP_POLL_S):
        if should_stop():
            logger.warning("the launch is to stop: ending every rank of this launch")
            ranks.end()
            return


def _stop_runner(runner: subprocess.Popen[bytes]) -> None:
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

    def interrupt(signum: int, frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
