"""The stall detector (textsql.launching.stall) on an injected clock, the heartbeat lines it reads, and the
supervisor's stall settings; the real stall (a SIGSTOPped rank) is in tests/test_recovery.py."""

from __future__ import annotations

import io

import pytest

from textsql.arguments import train_argv
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.failures import FailureKind
from textsql.launching.launch_watch import LaunchWatch
from textsql.launching.recovery import classify
from textsql.launching.stall import MIN_STALL_TIMEOUT_S, STALL_FACTOR, StallDetector
from textsql.launching.supervisor import PROCESS_GROUP_TIMEOUT_S, Supervisor, process_group_timeout
from textsql.launching.training_plan import TrainingPlan
from textsql.planning.train_args import parse_command_line
from textsql.rank_lines import HEARTBEAT_LINE, heartbeat_line, ranks_by_host, split_host_prefix
from worker.beats import Beat

# Hostfiles: host to slots.
ONE_HOST = {"a": 1}
TWO_HOSTS = {"a": 1, "b": 1}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def beat(detector: StallDetector, host: str, rank: int, step: int, progress: int) -> None:
    detector.read(f"{host}: {heartbeat_line(rank, step, progress)}")


def test_the_heartbeat_line_reads_back():
    host, text = split_host_prefix("127.0.0.3: " + heartbeat_line(1, 4, 9), ["127.0.0.2", "127.0.0.3"])
    found = HEARTBEAT_LINE.match(text)
    assert (host, found["rank"], found["step"], found["progress"]) == ("127.0.0.3", "1", "4", "9")
    assert split_host_prefix("127.0.0.4: " + heartbeat_line(1, 4, 9), ["127.0.0.2"]) == (
        None,
        "127.0.0.4: " + heartbeat_line(1, 4, 9),
    )


def test_ranks_are_numbered_in_the_hostfiles_order_as_deepspeed_numbers_them():
    assert ranks_by_host({"b": 2, "a": 1, "c": 3}) == {"b": range(2), "a": range(2, 3), "c": range(3, 6)}


def test_nothing_stalls_before_the_first_progress_however_long_the_start_takes(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=ONE_HOST)
    beat(detector, "a", 0, 0, 0)
    clock.now += 10_000
    assert not detector.stalled()


def test_a_given_timeout_counts_from_the_last_progress(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=ONE_HOST)
    beat(detector, "a", 0, 1, 1)
    clock.now += 25
    beat(detector, "a", 0, 2, 2)
    clock.now += 29
    beat(detector, "a", 0, 2, 2)  # alive, but no further
    assert not detector.stalled()
    clock.now += 2
    assert detector.stalled() and detector.step == 2


def test_the_default_timeout_is_a_multiple_of_the_slowest_step_and_never_below_the_minimum(clock):
    detector = StallDetector(clock=clock)
    detector.read("step 1/10: loss 1.000 (300 s)")  # the first step: compilation, never a step time
    assert detector.limit() is None
    clock.now += 10
    detector.read("step 2/10: loss 0.900 (310 s)")
    assert detector.limit() == MIN_STALL_TIMEOUT_S
    clock.now += 50
    detector.read("step 3/10: loss 0.800 (360 s)")
    assert detector.limit() == STALL_FACTOR * 50
    clock.now += STALL_FACTOR * 50 - 1
    assert not detector.stalled()
    clock.now += 2
    assert detector.stalled()


def test_an_evaluation_or_a_save_is_progress_without_a_new_step(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=ONE_HOST)
    for progress in range(1, 10):
        beat(detector, "a", 0, 5, progress)
        clock.now += 20
    assert not detector.stalled()


def test_the_stalled_host_is_the_one_whose_heartbeat_went_silent(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=TWO_HOSTS)
    beat(detector, "a", 0, 3, 3)
    beat(detector, "b", 1, 3, 3)
    for _ in range(7):  # b is stopped; a waits for it in a collective and goes on beating
        clock.now += 5
        beat(detector, "a", 0, 3, 3)
    assert detector.stalled()
    assert detector.stalled_hosts() == ["b"]


def test_a_host_of_the_launch_never_heard_from_is_stalled(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=TWO_HOSTS)
    beat(detector, "a", 0, 3, 3)
    clock.now += 31
    beat(detector, "a", 0, 3, 3)
    assert detector.stalled() and detector.stalled_hosts() == ["b"]


def test_one_host_reporting_progress_cannot_keep_a_run_alive_whose_other_host_is_frozen(clock):
    """A host's word keeps only itself alive: b froze, a (hostile, or counting what it never finished) reports
    ever more; once b has been silent for the stall timeout the run is stalled, on b."""
    detector = StallDetector(timeout=30, clock=clock, hosts=TWO_HOSTS)
    beat(detector, "a", 0, 1, 1)
    beat(detector, "b", 1, 1, 1)
    for count in range(2, 8):
        clock.now += 5
        beat(detector, "a", 0, count, count)
    assert not detector.stalled()
    for count in range(8, 12):
        clock.now += 5
        beat(detector, "a", 0, count, count)
    assert detector.stalled() and detector.stalled_hosts() == ["b"]
    assert detector.summary() == "no heartbeat from b for over 30 s (the stall timeout)"


def test_a_host_cannot_beat_for_another_hosts_rank_or_from_behind_no_prefix(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=TWO_HOSTS)
    beat(detector, "b", 0, 9, 9000)  # rank 0 runs on a
    detector.read(heartbeat_line(0, 9, 9000))  # no host's prefix: not a rank's line at all
    detector.read(f"c: {heartbeat_line(0, 9, 9000)}")  # not a host of the launch
    assert detector.counts == {} and detector.beats == {}
    beat(detector, "a", 0, 1, 5)
    beat(detector, "b", 1, 1, 5)
    beat(detector, "b", 1, 1, 2)  # a count never goes back
    assert detector.counts == {("a", 0): 5, ("b", 1): 5}
    # Rank 0's step lines only from rank 0's host.
    detector.read("b: step 7/10: loss 1.000 (9 s)")
    assert detector.step == 1


def test_a_host_heard_from_its_agent_is_believed_from_its_agent_alone(clock):
    """Where a host's agent relays its ranks' heartbeats (signed with its pod's key), its heartbeat lines on pdsh's
    stream, which another host can glue away or forge the bytes of, count for nothing."""
    detector = StallDetector(timeout=30, clock=clock, hosts=TWO_HOSTS, relayed=frozenset({"a"}))
    beat(detector, "a", 0, 9, 9000)
    assert detector.counts == {}
    detector.beat("a", Beat(rank=0, step=1, progress=1))
    detector.beat("a", Beat(rank=1, step=9, progress=9000))  # rank 1 runs on b
    detector.beat("c", Beat(rank=1, step=9, progress=9000))  # not a host of the launch
    beat(detector, "b", 1, 1, 1)  # b has no agent: its lines count
    assert detector.counts == {("a", 0): 1, ("b", 1): 1}


def test_a_line_glued_onto_another_hosts_is_nobodys_word(clock):
    """pdsh prints with %s: a NUL drops a host's newline and the next line, another host's, is glued on. What
    follows another host's prefix inside a line is credited to neither (a forgery is the same bytes)."""
    hosts = {"127.0.0.2": 1, "127.0.0.3": 1}
    glued = "127.0.0.3: x127.0.0.2: " + heartbeat_line(0, 4, 9)
    assert split_host_prefix(glued, hosts) == ("127.0.0.3", "x")
    assert split_host_prefix("127.0.0.3: 127.0.0.2: " + heartbeat_line(0, 4, 9), hosts) == ("127.0.0.3", "")
    assert split_host_prefix("127.0.0.3: see 127.0.0.4: ok", hosts) == ("127.0.0.3", "see 127.0.0.4: ok")
    detector = StallDetector(timeout=30, clock=clock, hosts=hosts)
    detector.read(glued)
    detector.read("127.0.0.3: x127.0.0.3: " + heartbeat_line(1, 4, 9))
    assert detector.counts == {}
    # A host's text of 128 KiB of ": " is cut in one pass: at the one prefix at its end.
    text = "a: " * 43_000 + "127.0.0.2: " + heartbeat_line(0, 4, 9)
    assert split_host_prefix("127.0.0.3: " + text, hosts) == ("127.0.0.3", "a: " * 43_000)


def test_when_every_host_still_beats_every_host_is_named(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=TWO_HOSTS)
    for _ in range(8):
        beat(detector, "b", 1, 3, 3)
        beat(detector, "a", 0, 3, 3)
        clock.now += 5
    assert detector.stalled_hosts() == ["a", "b"]


def test_a_stalled_launch_is_classified_as_a_stall_naming_the_host_not_as_the_kill_that_ended_it(clock):
    detector = StallDetector(timeout=30, clock=clock, hosts=TWO_HOSTS)
    watch = LaunchWatch(io.StringIO(), ["a", "b"], detector=detector)
    watch.write(f"a: {heartbeat_line(0, 3, 3)}\nb: {heartbeat_line(1, 3, 3)}\n")
    clock.now += 31
    watch.write(f"a: {heartbeat_line(0, 3, 3)}\n")
    assert watch.stalled()
    # How this side ended the stopped rank: SIGKILL after the grace, which alone would read as a lost worker.
    watch.write("b: [2026-01-01 10:00:00,000] [ERROR] [launch.py:1:main] exits with return code = -9\n")
    failure = classify(1, watch, {})
    assert failure.kind is FailureKind.STALL and failure.host == "b"
    assert failure.message == "no rank advanced for 31 s (stall timeout 30 s); stalled: b"


def test_the_process_group_timeout_is_bounded_by_the_stall_timeout():
    assert process_group_timeout(20.5) == 41
    assert process_group_timeout(None) == PROCESS_GROUP_TIMEOUT_S < 1800


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    return tmp_path


def test_a_stall_timeout_too_short_for_the_heartbeat_is_refused_in_one_line(run_dir):
    arguments = LaunchArguments(run_dir=run_dir, module="standin_rank")
    with pytest.raises(LaunchError, match=r"^--stall-timeout 5 must be at least 20 seconds \(or left out"):
        Supervisor(arguments, stall_timeout=5, plan=TrainingPlan.read(arguments))


def test_the_supervisor_lowers_the_ranks_process_group_timeout_to_the_bound(run_dir):
    train_args = train_argv(data_dir=run_dir, profile="zero1")
    arguments = LaunchArguments(run_dir=run_dir, train_args=train_args)
    supervisor = Supervisor(arguments, stall_timeout=30, plan=TrainingPlan(ddp_timeout=1800))
    assert supervisor.overrides == {"ddp_timeout": 60}
    _, _, _, training = parse_command_line(
        [*train_argv(run_dir=run_dir), *train_args, *train_argv(**supervisor.overrides)]
    )
    assert training["ddp_timeout"] == 60
    assert Supervisor(arguments, stall_timeout=30, plan=TrainingPlan(ddp_timeout=20)).overrides == {}
