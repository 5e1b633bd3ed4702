"""What a run shows a person as it goes: quiet by default, one switch for everything.

One log level holds for every process of a run: the CLI's ``--verbose``, a notebook's ``log_level``
parameter, and the kernels and launchers they start (through ``TEXTSQL_LOG_LEVEL``, which is also how a
CML job sets the notebooks' ``log_level``). At the default, ``warning``, third-party libraries log only
warnings, their progress bars are off, and of the ranks' output only this package's own lines (stage
lines, ``step N/M`` progress) and errors reach the terminal or notebook; every line still goes to the
run's ``launch.log``. ``info`` or ``debug`` bring all of it back.

Usage::

    >>> set_log_level("warning")            # a notebook's first cell; the CLI calls configure_cli
    >>> shown_rank_line("127.0.0.2: [2026-01-01 10:00:00,000] [INFO] [launch.py:145:main] ...")
    False
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import Protocol

from textsql.errors import TextSQLError
from textsql.sanitize import sanitized_lines

logger = logging.getLogger(__name__)

LOG_LEVEL_VAR = "TEXTSQL_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "warning"
# Loggers of the libraries a run uses; the root logger stays at INFO for this package's own messages.
THIRD_PARTY_LOGGERS = (
    "datasets",
    "transformers",
    "accelerate",
    "DeepSpeed",
    "deepspeed",
    "torch",
    "papermill",
    "nbclient",
    "traitlets",
    "tensorboard",
    "absl",
    "werkzeug",
    "huggingface_hub",
    "filelock",
    "urllib3",
    "httpx",
    "matplotlib",
    "asyncio",
    # A checkpoint store's (s3fs on aiobotocore): "Found credentials in environment variables" on every open.
    "fsspec",
    "s3fs",
    "aiobotocore",
    "botocore",
)
# Read by the libraries at import, so kernels and ranks started from here are quiet from their first line.
# The hub's switch also turns off transformers' "Loading weights" bar, which flashes by for every model load.
QUIET_ENVIRONMENT = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
# Third-party warnings a person can do nothing about, dropped at the default level: DeepSpeed warns on every
# import on a machine without a GPU, where the CPU accelerator is what this project means to use.
QUIET_WARNINGS = {"DeepSpeed": ("Setting accelerator to CPU",)}
# tqdm.auto in a kernel without ipywidgets warns on every import; the text progress bar works.
IPROGRESS_WARNING = "IProgress not found"
# Ranks' lines that reach the terminal at the default level: this package's own log lines, stage and
# step lines, and errors; DeepSpeed's launcher INFO, warnings and progress bars only go to launch.log.
SHOWN_RANK_LINE = re.compile(
    r"^(?:\S+: )?(?:\[rank\d+\]: )?(?:\d\d:\d\d:\d\d (?:WARNING|ERROR|CRITICAL) (?:textsql|__main__)"
    r"|step \d+/\d+|stage: |Error: |Traceback |\w*(?:Error|Exception)\b)"
    r"|^pdsh@\S+: \S+: ssh exited with exit code [1-9]"
    r"|^\[supervisor\] "
)


def log_level() -> str:
    """The run's log level: ``TEXTSQL_LOG_LEVEL``, else ``warning``.

    :rtype: str
    """
    return os.environ.get(LOG_LEVEL_VAR, DEFAULT_LOG_LEVEL).strip().lower() or DEFAULT_LOG_LEVEL


def is_verbose() -> bool:
    """Whether the run shows third-party output (log level ``info`` or ``debug``).

    :rtype: bool
    """
    return logging.getLevelName(log_level().upper()) <= logging.INFO


def set_log_level(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Set the run's log level in this process and for every process it starts.

    :param level: ``debug``, ``info``, ``warning`` (quiet, the default) or ``error``.
    :raises TextSQLError: for another level, naming the known ones.
    """
    level = str(level).strip().lower()
    if level not in LOG_LEVELS:
        raise TextSQLError(f"unknown log_level {level!r}; pass log_level one of {', '.join(LOG_LEVELS)}")
    os.environ[LOG_LEVEL_VAR] = level
    verbose = is_verbose()
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.getLevelName(level.upper()) if verbose else logging.WARNING)
    for name in QUIET_WARNINGS:
        # A logger's filters outlive the library's own setup of it (DeepSpeed sets its level and handler at import).
        (logging.getLogger(name).removeFilter if verbose else logging.getLogger(name).addFilter)(_KNOWN_WARNINGS)
    if verbose:
        for name in QUIET_ENVIRONMENT:
            os.environ.pop(name, None)
        return
    os.environ.update(QUIET_ENVIRONMENT)
    warnings.filterwarnings("ignore", message=IPROGRESS_WARNING)
    filters = [entry for entry in os.environ.get("PYTHONWARNINGS", "").split(",") if entry]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys([*filters, f"ignore:{IPROGRESS_WARNING}"]))
    # Libraries imported before this call read their switches already; tell them directly.
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.set_verbosity_warning()
        sys.modules["transformers"].utils.logging.disable_progress_bar()


class KnownWarnings(logging.Filter):
    """Drops the records of :data:`QUIET_WARNINGS`: a filter on the library's logger, so its level stays as set."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(prefix) for prefix in QUIET_WARNINGS.get(record.name, ()))


_KNOWN_WARNINGS = KnownWarnings()


def configure_cli(verbose: bool) -> None:
    """Log this package's messages to stderr, third-party ones only when ``verbose`` (the CLI's ``--verbose``).

    :param verbose: show third-party output and this package's debug messages.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    set_log_level("debug" if verbose else log_level())


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless one.

    Usage::

        >>> counted(1, "question"), counted(3, "table")
        ('1 question', '3 tables')

    :rtype: str
    """
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class TextSink(Protocol):
    """Where a launch writes the ranks' lines: a text stream, or a filter in front of one (:class:`SanitizedLines`)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class SanitizedLines:
    """A text stream that passes on only the ranks' lines :func:`shown_rank_line` picks, made safe to show
    (:mod:`textsql.sanitize`: a rank's text cannot write escapes or start a line of its own).

    :func:`textsql.launching.launch.launch` and the supervisor see every line (the supervisor reads exit codes
    and exceptions from them) and write them all to ``launch.log``; only what a person is shown is
    filtered, here, at the edge.
    """

    def __init__(self, target: TextSink) -> None:
        self.target = target

    def write(self, text: str) -> int:
        *lines, last = sanitized_lines(text)
        for line in lines:
            if shown_rank_line(line):
                self.target.write(line + "\n")
        # Every writer here hands over whole lines; a last piece without its newline is shown as it is.
        if last and shown_rank_line(last):
            self.target.write(last)
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def shown_rank_line(line: str) -> bool:
    """Whether a line of the ranks' output reaches the terminal or notebook at the run's log level.

    :param line: one line as the launcher prints it (``host: `` prefix from pdsh).
    :rtype: bool
    """
    return is_verbose() or bool(SHOWN_RANK_LINE.search(line))
