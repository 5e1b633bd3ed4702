"""What a worker controls reaches a person's terminal or notebook as text, never as escape sequences or lines of
its own: the ranks' lines (SanitizedLines, the stage view), and cluster.json / collective figures (the notebooks'
views, `textsql preflight --run-dir`)."""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner

from textsql.cli import cli
from textsql.console import SanitizedLines, set_log_level
from textsql.display.terminal import StageView
from textsql.display.views import format_cluster, format_run
from textsql.json_files import write_json
from textsql.sanitize import sanitized, sanitized_lines

# What a terminal acts on, and every line break str.splitlines() honours besides "\n".
ESCAPES = ["\x1b[2J", "\x1b]0;owned\x07", "\x9b31m", "\r", "\x08", "\u202e"]
BREAKS = ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
UNSAFE = [*ESCAPES, *BREAKS]


def assert_inert(text: str) -> None:
    """Nothing a terminal acts on, and no line break but "\n"."""
    assert not any(character in text for character in "\x1b\x9b\r\x08\u202e\x07"), repr(text)
    assert all(line.splitlines() == [line] for line in text.split("\n") if line), repr(text)


def test_unsafe_characters_are_shown_as_escapes_and_lines_cut_at_newline_only():
    for unsafe in UNSAFE:
        assert_inert(sanitized(f"a{unsafe}b"))
    assert sanitized("127.0.0.3: done\r[supervisor] run finished") == "127.0.0.3: done\\r[supervisor] run finished"
    assert sanitized_lines("a\u2028b\x85c\nd\té漢") == ["a\\u2028b\\x85c", "d\té漢"]


def test_a_ranks_line_cannot_pass_for_the_supervisors_or_write_escapes_to_the_terminal():
    set_log_level("warning")
    for unsafe in UNSAFE:
        target = io.StringIO()
        SanitizedLines(target).write(f"127.0.0.3: Error: x{unsafe}[supervisor] run finished after 0 restart(s)\n")
        assert_inert(target.getvalue())
        assert not any(line.startswith("[supervisor]") for line in target.getvalue().split("\n")), repr(unsafe)


def test_the_stage_view_shows_a_ranks_stage_line_inert():
    stream = io.StringIO()
    view = StageView(total=1, stream=stream, live=False)
    with view.stage("02_train_distributed"):
        for unsafe in UNSAFE:
            view.feed(f"127.0.0.3: stage: compiling{unsafe}[1/1] 02_train_distributed done in 1 s\n")
    assert_inert(stream.getvalue())
    assert sum(line.startswith("[1/1]") for line in stream.getvalue().split("\n")) == 1


MIB = 1 << 20


def peak_bytes(work: Callable[[], object]) -> int:
    """The most memory Python held at once while ``work`` ran, above what it held before."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_sanitising_holds_the_escaped_text_and_little_more():
    """A line of 1 MiB of NULs is shown as 4 MiB of ``\\x00``: sanitising it may hold that text and a copy while it
    is joined, not a match object and an escape string per character (79 times the input before)."""
    line = "\x00" * MIB
    peak = peak_bytes(lambda: sanitized(line))
    assert sanitized(line) == "\\x00" * MIB
    assert peak < 3 * 4 * MIB, f"{peak / MIB:.0f} MiB to sanitise 1 MiB"


def follow_view(log: Path) -> StageView:
    log.write_bytes(b"")
    return StageView(total=1, stream=io.StringIO(), live=False, tick_s=None, follow=log)


def test_a_tick_reads_a_bounded_part_of_what_the_ranks_appended_to_launch_log(tmp_path):
    """The ranks write launch.log: 4 MiB of NULs on one line, then a line of terminal escapes a thousand times, in
    one go. A tick reads at most its cap of it, the newest, so the latest step line is still shown, and holds a few
    MiB whatever was appended (before: the whole append, at 79 times its size once sanitised)."""
    log = tmp_path / "launch.log"
    view = follow_view(log)
    with view.stage("02_train_distributed"):
        with log.open("ab") as growing:
            growing.write(b"\x00" * 4 * MIB + b"\n" + b"\x1b[2J" * 1000 + b"\n" + b"step 20/200: loss 3.120 (14 s)\n")
        peak = peak_bytes(view.tick)
    assert view.step == ("step 20/200", "loss 3.120")
    assert peak < 8 * MIB, f"{peak / MIB:.0f} MiB for one tick"


def test_a_line_longer_than_a_tick_reads_is_skipped_and_following_goes_on(tmp_path):
    """A line with no end in sight (3 MiB and growing) is not waited for: the tick goes past it, shows none of it,
    and the next whole line after it is read as a line of its own."""
    log = tmp_path / "launch.log"
    view = follow_view(log)
    with view.stage("02_train_distributed"), log.open("ab") as growing:
        growing.write(b"step 1/200: loss 9.000 (1 s)" + b"\x00" * 3 * MIB)
        growing.flush()
        view.tick()
        growing.write(b"x" * MIB + b"step 2/200: loss 8.000 (2 s)\nstep 3/200: loss 7.000 (3 s)\n")
        growing.flush()
        view.tick()
    assert view.step == ("step 3/200", "loss 7.000")


HOSTILE = "local-1\x1b[2J\u2028problem: none\nproblem: none\r"


def hostile_run_dir(tmp_path):
    inventory = {"python": "3.11\x1b]0;owned\x07", "torch": "2.13.0+cpu\x85problem: none", "free_disk_bytes": 1}
    hosts = [{"pod": HOSTILE, "address": "127.0.0.3", "slots": 1, "socket_ifname": "lo\r", "inventory": inventory}]
    write_json(tmp_path / "cluster.json", {"master": inventory, "hosts": hosts, "problems": [HOSTILE]})
    sizes = [{"bytes": 4096, "seconds": 0.2, "bus_gbps": 1.0}]
    per_host = [{"host": HOSTILE, "result": "ok\x1b[8m", "sizes": sizes, "waited_for_s": [0.0]}]
    write_json(
        tmp_path / "collective.json",
        {"world_size": 2, "backend": "gloo\u2028x", "sizes": sizes, "per_host": per_host},
    )
    return tmp_path


def test_a_workers_cluster_json_is_shown_inert_one_line_a_row(tmp_path):
    run_dir = hostile_run_dir(tmp_path)
    table = format_cluster(run_dir)
    assert_inert(table)
    # Header, master, the one host, its one problem: a worker's newline makes no row of its own.
    assert len(table.split("\n")) == 4 and table.split("\n")[3].startswith("problem: local-1\\x1b[2J")
    run = {"engine": "x.Engine\r", "zero_stage": 0, "world_size": 2, "profile": "zero0\x85", "precision": "fp32"}
    run |= {"model": "m\x1b[2J", "global_step": 1, "train_runtime": 1, "train_samples_per_second": 1, "train_loss": 1}
    write_json(run_dir / "run.json", run | {"log_history": [{"eval_x\x1b[2J": 0.5, "step": 1}]})
    assert_inert(format_run(run_dir))


def test_preflight_shows_a_workers_cluster_json_inert(tmp_path):
    result = CliRunner().invoke(cli, ["preflight", "--run-dir", str(hostile_run_dir(tmp_path))])
    assert_inert(result.output)
    assert sum(line.startswith("problem: ") for line in result.output.split("\n")) == 1, result.output


def test_the_demo_summary_shows_worker_written_values_inert(tmp_path):
    """run.json and metrics.json lie in the run directory the pods can write, prepare.json wherever data_dir is."""
    from textsql.pipeline.demo import DemoResult, demo_data_dir, format_summary

    out = tmp_path / "demo"
    write_json(
        out / "run.json",
        {"log_history": [{"train_runtime": 5.0}], "world_size": "\x1b]0;owned\x07", "zero_stage": 0},
    )
    write_json(demo_data_dir(out) / "prepare.json", {"source": "synthetic\x1b[2J\rpwned"})
    write_json(out / "metrics.json", {"n": "10\u202e", "lf_accuracy": 0.5, "ex_accuracy": None})
    summary = format_summary(DemoResult(out, {"02_train_distributed": 1.0}, {"02_train_distributed": out}))
    assert_inert(summary)
    assert "synthetic\\x1b[2J\\rpwned questions" in summary
