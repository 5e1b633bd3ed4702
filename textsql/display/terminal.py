"""The terminal view of a long run: one line per stage with its time, and a live bar in between.

``textsql demo`` runs notebooks whose cells print hundreds of lines; at the default log level they go to
a log file, and the terminal shows only this: a bar for the running stage that ticks every second (so a
quiet minute still shows the clock moving), rank 0's ``step N/M`` lines (behind the prefix of the launch's first
host: :func:`textsql.rank_lines.rank0_step`) as its progress with the time left they measured
(:mod:`textsql.training.time_left`, counted down between lines), the ranks' ``stage:`` lines (DeepSpeed's
one-off op compilation) as lines of their own, and each stage's end. The step lines are read from the run's
``launch.log`` as it grows (``follow``): notebook 02 shows them as its own bar, not as lines of output.

Usage::

    >>> view = StageView(total=3)
    >>> with view.stage("01_prepare_dataset"):
    ...     view.feed("step 10/200: loss 3.2 (5 s)")
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from tqdm import tqdm

from textsql.display.step_bar import left_and_text, rank0_step_line
from textsql.rank_lines import STAGE_PREFIX
from textsql.sanitize import sanitized_lines
from worker.files import UnsafeRead, open_regular, private_opener

logger = logging.getLogger(__name__)

TICK_S = 1.0
# Where the stream is no terminal (a CI log, a captured pipe) a bar cannot redraw in place: a plain
# line at most this often when the progress moved, and one this often when it did not (the run is alive).
PLAIN_EVERY_S = 10.0
PLAIN_HEARTBEAT_S = 60.0
WAITING_FORMAT = "{desc}: {elapsed}{postfix}"
# The time left is the ranks' (in the postfix), never tqdm's: the stage's clock includes start-up.
STEPS_FORMAT = "{desc}: {percentage:3.0f}%|{bar:20}| {n}/{total} steps [{elapsed}{postfix}]"
# The most of the followed log one tick reads. The ranks write launch.log, so a tick must cost the same however much
# they appended at once; an honest run writes far less than this in a second, and past it a tick reads the newest.
FOLLOWED_BYTES_PER_TICK = 1 << 20


class StageView:
    """Stage lines and one live bar on ``stream`` (stderr), fed with the running stage's output lines.

    With ``live`` false (``--verbose``, where the cells' output is shown as it comes) only the stage lines;
    on a stream that is no terminal, or a terminal of no known size, a plain progress line every
    :data:`PLAIN_EVERY_S` instead of the bar.

    :param clock: seconds, monotonic; the times shown are differences of its readings.
    :param tick_s: seconds between the ticks of a thread that runs while a stage does (:meth:`tick`);
        ``None``: no thread, the caller ticks (a test driving its own clock).
    :param follow: a log each tick reads the stage's new lines of, as if fed (the run's ``launch.log``).
    :param run_dir: the run directory whose latest launch's hosts say whose step lines are rank 0's
        (:func:`textsql.display.step_bar.rank0_step_line`); None: the local launcher's, which carry no host's prefix.
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        live: bool = True,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float | None = TICK_S,
        follow: Path | None = None,
        run_dir: Path | None = None,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.live = live
        self.clock = clock
        self.tick_s = tick_s
        self.done = 0
        self.bar: tqdm | None = None
        self.started = 0.0
        self.label = ""
        self.progress = ""
        self.stage_lines: set[str] = set()
        # The latest step line's "step N/M" and text, and the time left it said with when it was read.
        self.step: tuple[str, str] | None = None
        self.left: tuple[float, float] | None = None
        self.follow, self._followed, self.run_dir = follow, 0, run_dir
        # Whether the followed log's next bytes end a line too long to read (what a tick skips past).
        self._skipping = False
        # Fed from papermill's log records and from the ticks' reads of `follow`.
        self._lock = threading.RLock()
        # When the last plain line was printed, and the progress it showed.
        self._last_plain = 0.0
        self._shown = ""

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Show a ticking bar while the block runs, then one line with the stage's time."""
        label = self.label = f"[{self.done + 1}/{self.total}] {name}"
        self.started, self.progress, self.stage_lines = self.clock(), "", set()
        self._last_plain, self._shown = self.started, ""
        self.step, self.left = None, None
        # Only what the stage adds: a resumed run's log already holds an earlier run's steps.
        self._followed = self.follow.stat().st_size if self.follow is not None and self.follow.is_file() else 0
        self._skipping = False
        if self.live and has_size(self.stream):
            # position 0: papermill's own (hidden) bar would otherwise push this one down a line per redraw.
            self.bar = tqdm(
                desc=label, file=self.stream, bar_format=WAITING_FORMAT, leave=False, dynamic_ncols=True, position=0
            )
        stop = threading.Event()
        ticker = threading.Thread(target=self._ticking, args=(stop,), daemon=True)
        if self.tick_s is not None:
            ticker.start()
        outcome = "failed after"
        try:
            yield
            outcome = "done in"
        finally:
            stop.set()
            if ticker.is_alive():
                ticker.join()
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            self.done += 1
            self._line(f"{label} {outcome} {self.clock() - self.started:.0f} s")

    def feed(self, text: str) -> None:
        """Take output of the running stage: ``step N/M`` moves the bar, ``stage:`` lines are shown."""
        with self._lock:
            for line in sanitized_lines(text):
                self._read(line.strip())

    def _read(self, line: str) -> None:
        step = rank0_step_line(line, self.run_dir)
        if step:
            self.step = (f"step {step['step']}/{step['total']}", step["text"])
            self.left = (float(step["left"]), self.clock()) if step["left"] is not None else None
            self.progress = f"{self.step[0]}: {step['text']}"
        if self.bar is not None and step:
            if self.bar.total != int(step["total"]):
                self.bar.bar_format, self.bar.total = STEPS_FORMAT, int(step["total"])
            self.bar.n = int(step["step"])
            self.bar.set_postfix_str(self._postfix(), refresh=True)
        elif STAGE_PREFIX in line and line.partition(STAGE_PREFIX)[2] not in self.stage_lines:
            # Every node says it compiles the op (each compiles its own copy): one line for the person.
            self.stage_lines.add(line.partition(STAGE_PREFIX)[2])
            self._line(f"      {line.partition(STAGE_PREFIX)[2]} (at {self.clock() - self.started:.0f} s)")

    def seconds_left(self) -> float | None:
        """The time left the latest step line said, less the time since it was read; None while not known.

        :rtype: float | None
        """
        return None if self.left is None else max(0.0, self.left[0] - (self.clock() - self.left[1]))

    def _postfix(self) -> str:
        return left_and_text(self.seconds_left(), self.step[1]) if self.step is not None else ""

    def _line(self, text: str) -> None:
        tqdm.write(text, file=self.stream)

    def tick(self) -> None:
        """Read what ``follow`` gained, redraw the bar (its clock moves and the time left counts down), or where
        there is none print a plain line if one is due."""
        with self._lock:
            self._read_followed()
            # tqdm redraws only on updates; a stage can be silent for minutes (op compilation, rank start-up).
            if self.bar is not None:
                if self.left is not None:
                    self.bar.set_postfix_str(self._postfix(), refresh=False)
                self.bar.refresh()
                return
            now = self.clock()
            quiet = now - self._last_plain
            if self.live and (quiet >= PLAIN_HEARTBEAT_S or (quiet >= PLAIN_EVERY_S and self.progress != self._shown)):
                self._last_plain, self._shown = now, self.progress
                shown = f"{self.step[0]}: {self._postfix()}" if self.step is not None else ""
                self._line(f"{self.label}: {now - self.started:.0f} s {shown}".rstrip())

    def _read_followed(self) -> None:
        if self.follow is None:
            return
        try:
            with open_regular(self.follow) as log:
                complete = self._whole_lines_gained(log)
        except (OSError, UnsafeRead):  # not written yet, or not a regular file: nothing of it is shown
            return
        for line in sanitized_lines(complete.decode("utf-8", errors="replace"))[:-1]:
            self._read(line.strip())

    def _whole_lines_gained(self, log: BinaryIO) -> bytes:
        """The whole lines ``log`` gained since the last tick, of at most its newest :data:`FOLLOWED_BYTES_PER_TICK`
        bytes. A line cut there is skipped to its end: no step line is that long."""
        size = os.fstat(log.fileno()).st_size
        if size <= self._followed:
            return b""
        start = max(self._followed, size - FOLLOWED_BYTES_PER_TICK)
        skipping = self._skipping or start > self._followed
        log.seek(start)
        grown = log.read(size - start)
        if skipping:
            cut_line_end = grown.find(b"\n") + 1
            if not cut_line_end:
                self._followed, self._skipping = size, True
                return b""
            grown, start = grown[cut_line_end:], start + cut_line_end
        # Whole lines only (never a character cut in two): a line still being written is read at the next tick.
        complete = grown[: grown.rfind(b"\n") + 1]
        self._followed, self._skipping = start + len(complete), False
        return complete

    def _ticking(self, stop: threading.Event) -> None:
        assert self.tick_s is not None
        while not stop.wait(self.tick_s):
            self.tick()


def has_size(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that knows its size. A bare pty (some CI runners) reports 0 x 0, where
    tqdm draws nothing at all; a stream with no file descriptor has no size to ask for."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        return False
    return stream.isatty() and size.columns > 0 and size.lines > 0


class CellOutput(logging.Handler):
    """Papermill's live record of the cells' output: all of it to a log file, each text to a :class:`StageView`."""

    def __init__(self, path: Path, view: StageView) -> None:
        # The log lies in the run directory the pods share: a link planted there is refused, never written through.
        # Opened before the handler exists for logging, which closes every handler it knows at exit: one whose open
        # failed would end the refusal's one line with an AttributeError from close().
        self.file = open(path, "a", encoding="utf-8", opener=private_opener)  # noqa: SIM115 - closed in close()
        super().__init__()
        self.path = path
        self.view = view
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        self.file.write(self.format(record) + "\n")
        self.file.flush()
        self.view.feed(record.getMessage())

    def close(self) -> None:
        self.file.close()
        super().close()


@contextlib.contextmanager
def cell_output_to(path: Path, view: StageView, logger_name: str = "papermill") -> Iterator[None]:
    """Route a logger's records (papermill's cell output) to ``path`` and ``view`` instead of the terminal.

    :param path: the log file (appended).
    :param view: the stage view fed with every record.
    :param logger_name: the logger whose records are taken.
    """
    source = logging.getLogger(logger_name)
    handler = CellOutput(path, view)
    saved = source.propagate, source.level
    source.addHandler(handler)
    source.propagate, source.level = False, logging.INFO
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.propagate, source.level = saved
        handler.close()
