"""One live progress bar in a notebook instead of a stream of ``step N/M`` lines.

In a notebook kernel at the default log level, :func:`shown_output` puts a :class:`StepBar` behind the filter of
what a person is shown (:class:`textsql.console.SanitizedLines`): rank 0's ``step N/M: loss`` lines (behind the
prefix of the launch's first host: :func:`textsql.rank_lines.rank0_step`) move tqdm's notebook bar
(``tqdm.auto``: a widget in JupyterLab and in a papermill run's executed notebook, whose text fallback is one
line), which shows the time left the ranks measured (:mod:`textsql.training.time_left`); every other line (each
evaluation's scores, another host's step lines, stage lines, the supervisor's, errors) is printed as before. ``launch.log``
keeps every line. Elsewhere (a terminal, ``--verbose``) the lines are printed as they come.

Usage::

    >>> with shown_output() as stream:                      # in a notebook: a bar
    ...     stream.write("step 10/2000: loss 3.210 (41 s)\\n")
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from textsql.console import SanitizedLines, TextSink, is_verbose
from textsql.rank_lines import STEP_LINE, rank0_step
from textsql.rundir.master_state import launch_hosts

# The notebook bar's line: tqdm.notebook draws its widget where "{bar}" stands.
NOTEBOOK_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} steps [{elapsed}{postfix}]"
LOSS_PREFIX = "loss "


def left_and_text(left_s: float | None, text: str) -> str:
    """A bar's postfix: the time left first (once known), then the step's own text.

    :param left_s: seconds left, or None.
    :param text: what the step line says (``loss 3.210``).
    :rtype: str
    """
    return text if left_s is None else f"{tqdm.format_interval(left_s)} left, {text}"


def rank0_step_line(line: str, run_dir: Path | None) -> re.Match[str] | None:
    """``line`` read as rank 0's step line (:func:`textsql.rank_lines.rank0_step`) of the run's latest launch, whose
    hosts the launch keeps in the run's master-private directory (:func:`textsql.rundir.master_state.launch_hosts`); None for any
    other line, a step line from another host included.

    :param line: a line of the launch's output.
    :param run_dir: its run directory (None: the local launcher, whose lines carry no host's prefix).
    :rtype: re.Match | None
    """
    if not STEP_LINE.match(line):  # the hosts are read only for a step line
        return None
    return rank0_step(line, launch_hosts(run_dir) if run_dir is not None else [])


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (JupyterLab, papermill), as ``tqdm.auto`` decides.

    :rtype: bool
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in shell.config


class StepBar:
    """Shown lines on their way to ``target``: ``step N/M: loss`` lines move one progress bar instead.

    :param target: where every other line goes.
    :param bar: makes the bar (``tqdm.auto.tqdm``'s arguments); a test passes a plain tqdm on a stream.
    :param run_dir: the run directory whose latest launch's hosts say whose step lines are rank 0's
        (:func:`rank0_step_line`); None: the local launcher's, which carry no host's prefix.
    """

    def __init__(self, target: TextIO, bar: Callable[..., tqdm] | None = None, run_dir: Path | None = None) -> None:
        self.target, self.run_dir = target, run_dir
        self.make_bar = bar or _notebook_bar
        self.bar: tqdm | None = None
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def close(self) -> None:
        """Leave the bar as it ended (tqdm marks one short of its total as failed)."""
        if self._partial:
            self._line(self._partial)
            self._partial = ""
        if self.bar is not None:
            self.bar.close()

    def _line(self, line: str) -> None:
        # Another host's step line is shown as a line of its own, never as the run's progress.
        step = rank0_step_line(line, self.run_dir)
        if step is None or not step["text"].startswith(LOSS_PREFIX):
            self.target.write(line + "\n")
            return
        if self.bar is None:
            self.bar = self.make_bar(total=int(step["total"]), desc="training", bar_format=NOTEBOOK_FORMAT)
        self.bar.n = int(step["step"])
        left = int(step["left"]) if step["left"] is not None else None
        self.bar.set_postfix_str(left_and_text(left, step["text"]), refresh=True)


def _notebook_bar(**arguments: Any) -> tqdm:
    """tqdm's notebook bar, whose text in a saved notebook (what a viewer without widgets shows) is redrawn when it
    closes, so it says how the run ended, not how it began; tqdm's text bar where ipywidgets is missing."""
    from IPython.display import display
    from tqdm.auto import tqdm as auto
    from tqdm.notebook import tqdm as notebook

    if not issubclass(auto, notebook):
        return auto(**arguments)

    class NotebookBar(notebook):
        def __init__(self, **arguments: Any) -> None:
            super().__init__(display=False, **arguments)
            self.shown = display(self.container, display_id=True)

        def close(self) -> None:
            # tqdm closes a bar again when it is collected, where its widget can no longer read it: once only.
            if self.disable:
                return
            super().close()
            self.shown.update(self.container)

    return NotebookBar(**arguments)


@contextlib.contextmanager
def shown_output(target: TextIO | None = None, run_dir: Path | None = None) -> Iterator[TextSink]:
    """Where a launch's lines go for a person: in a notebook kernel at the default log level through a
    :class:`StepBar`, else as lines; either way filtered and made safe by :class:`textsql.console.SanitizedLines`.

    :param target: the stream (default: sys.stdout).
    :param run_dir: the launches' run directory, whose latest launch's first host runs rank 0 (None: the local
        launcher).
    """
    target = target or sys.stdout
    if not in_notebook() or is_verbose():
        yield SanitizedLines(target)
        return
    bar = StepBar(target, run_dir=run_dir)
    try:
        yield SanitizedLines(bar)
    finally:
        bar.close()
