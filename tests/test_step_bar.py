"""Notebook 02's progress: one bar with the time left instead of a line every 10 steps (textsql/display/step_bar.py)."""

from __future__ import annotations

import io

import nbformat
import pytest
from helpers.notebooks import output_lines
from nbclient import NotebookClient
from tqdm import tqdm

from textsql.console import SanitizedLines
from textsql.display.step_bar import StepBar, shown_output
from textsql.rundir.master_state import record_launch_hosts

STEPS = 2000
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def plain_bar(stream: io.StringIO):
    return lambda **arguments: tqdm(file=stream, mininterval=0, ncols=120, **arguments)


@pytest.fixture
def run_dir(tmp_path):
    """A run whose launch runs rank 0 on 127.0.0.2, as the launch records it."""
    record_launch_hosts(tmp_path, ["127.0.0.2", "127.0.0.3"])
    return tmp_path


def test_step_lines_move_the_bar_and_every_other_line_is_printed(run_dir):
    printed, drawn = io.StringIO(), io.StringIO()
    bar = StepBar(printed, bar=plain_bar(drawn), run_dir=run_dir)
    stream = SanitizedLines(bar)
    for step in range(10, STEPS + 1, 10):
        left = f", {(STEPS - step) // 10} s left" if step > 500 else ""
        stream.write(f"127.0.0.2: step {step}/{STEPS}: loss {5 - step / 1000:.3f} ({step // 10} s{left})\n")
        if step == 500:
            stream.write(f"127.0.0.2: step {step}/{STEPS}: eval loss 2.100, lf_accuracy 0.400 (50 s)\n")
            stream.write("[supervisor] a line of the supervisor\n")
    bar.close()
    assert printed.getvalue().splitlines() == [
        "127.0.0.2: step 500/2000: eval loss 2.100, lf_accuracy 0.400 (50 s)",
        "[supervisor] a line of the supervisor",
    ]
    last = drawn.getvalue().rpartition("\r")[2]
    assert "2000/2000 steps" in last and "00:00 left, loss 3.000]" in last, last
    assert "01:30 left, loss 3.900]" in drawn.getvalue(), "the ranks' time left at step 1100"


def test_a_rank_cannot_write_escapes_into_the_bar(run_dir):
    drawn = io.StringIO()
    bar = StepBar(io.StringIO(), bar=plain_bar(drawn), run_dir=run_dir)
    SanitizedLines(bar).write("127.0.0.2: step 10/20: loss 1.000\x1b]0;owned\x07 (3 s)\n")
    bar.close()
    assert "\x1b]0;owned" not in drawn.getvalue() and "\\x1b]0;owned\\x07" in drawn.getvalue()


def test_the_bar_believes_step_lines_from_rank_0s_host_only(run_dir):
    """A worker on the second host prints a step line as if it were rank 0 (as the supervisor reads them,
    textsql.launching.launch_watch): the bar stays at rank 0's step 10 and the line is shown as any other."""
    printed, drawn = io.StringIO(), io.StringIO()
    bar = StepBar(printed, bar=plain_bar(drawn), run_dir=run_dir)
    stream = SanitizedLines(bar)
    stream.write(f"127.0.0.2: step 10/{STEPS}: loss 4.990 (1 s)\n")
    stream.write(f"127.0.0.3: step 1999/{STEPS}: loss 0.001 (2 s, 1 s left)\n")
    assert bar.bar.n == 10
    bar.close()
    assert printed.getvalue() == f"127.0.0.3: step 1999/{STEPS}: loss 0.001 (2 s, 1 s left)\n"
    assert "1999" not in drawn.getvalue()


def test_the_local_launchers_lines_carry_no_prefix_and_move_the_bar():
    """No launch hosts (the local launcher): unprefixed step lines are rank 0's, a prefixed one is no one's."""
    printed, drawn = io.StringIO(), io.StringIO()
    bar = StepBar(printed, bar=plain_bar(drawn))
    SanitizedLines(bar).write("step 10/20: loss 1.000 (3 s)\n127.0.0.3: step 19/20: loss 0.100 (4 s)\n")
    assert bar.bar.n == 10
    bar.close()
    assert printed.getvalue() == "127.0.0.3: step 19/20: loss 0.100 (4 s)\n"


def test_a_rank_cannot_write_html_into_the_notebook_bar():
    """In JupyterLab the bar is a widget whose text is HTML: what rank 0 prints after its loss reaches it escaped."""
    from tqdm.notebook import tqdm as notebook_bar

    made = []

    def widget_bar(**arguments):
        made.append(notebook_bar(display=False, **arguments))
        return made[-1]

    bar = StepBar(io.StringIO(), bar=widget_bar)
    SanitizedLines(bar).write('step 10/20: loss 1.000 <img src=x onerror="alert(1)"> (3 s)\n')
    bar.close()
    text = "".join(child.value for child in made[0].container.children if isinstance(child.value, str))
    assert "<img" not in text and "&lt;img" in text, text


def test_outside_a_notebook_the_lines_are_printed_as_they_come(capsys):
    with shown_output() as stream:
        stream.write("127.0.0.2: step 10/20: loss 1.000 (3 s)\n127.0.0.2: [INFO] noise\n")
    assert capsys.readouterr().out == "127.0.0.2: step 10/20: loss 1.000 (3 s)\n"


# What notebook 02's training cell does with the ranks' lines (the local launcher's: no host's prefix), in a
# real kernel as papermill runs it.
TRAINING_CELL = f"""
from textsql.display.step_bar import shown_output
with shown_output() as stream:
    for step in range(10, {STEPS} + 1, 10):
        stream.write(f"step {{step}}/{STEPS}: loss 1.000 ({{step}} s, {{{STEPS} - step}} s left)\\n")
        if step % 500 == 0:
            stream.write(f"step {{step}}/{STEPS}: eval loss 0.900 ({{step}} s)\\n")
"""
# tqdm closes a bar again when the bar is collected, when its widget can no longer read it: no error output then.
COLLECTED_CELL = """
import gc
from textsql.display.step_bar import shown_output
with shown_output() as stream:
    stream.write("step 10/20: loss 1.000 (10 s)\\nstep 20/20: loss 1.000 (20 s, 0 s left)\\n")
del stream
gc.collect()
print("collected")
"""


@pytest.mark.slow
def test_an_executed_notebook_holds_one_bar_not_a_line_every_10_steps():
    """200 step lines in a kernel (as notebook 02 gets for the demo's 2,000 steps): one widget, whose text
    fallback is a line, and the evaluations; the widget's last state (in the notebook's metadata) says 2000/2000."""
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(cell) for cell in (TRAINING_CELL, COLLECTED_CELL)]
    )
    NotebookClient(notebook, kernel_name="python3", timeout=120).execute()
    errors = [output for cell in notebook.cells for output in cell.outputs if output.output_type == "error"]
    assert not errors, errors
    lines = output_lines(notebook)
    assert lines == [
        f"training: 100%|##########| {STEPS}/{STEPS} steps [00:00, 00:00 left, loss 1.000]",
        *(f"step {step}/{STEPS}: eval loss 0.900 ({step} s)" for step in range(500, STEPS + 1, 500)),
        "training: 100%|##########| 20/20 steps [00:00, 00:00 left, loss 1.000]",
        "collected",
    ], "the bar's text says how it ended"
    (bar,) = [output for output in notebook.cells[0].outputs if WIDGET in output.get("data", {})]
    saved = notebook.metadata["widgets"][WIDGET_STATE]["state"]
    children = [
        saved[child.removeprefix("IPY_MODEL_")] for child in saved[bar["data"][WIDGET]["model_id"]]["state"]["children"]
    ]
    (progress,) = [child["state"] for child in children if child["model_name"] == "FloatProgressModel"]
    assert (progress["value"], progress["bar_style"]) == (STEPS, "success"), "the last state is saved for JupyterLab"
    assert len(nbformat.writes(notebook)) < 50_000, "the executed notebook stays small"
