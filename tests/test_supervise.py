"""The supervisor: a lost worker is recovered from, the same application error twice ends the run.

The slow tests run real launches over pdsh on two real `local` worker pods with a stand-in rank
program (as tests/test_launch.py does), so a restart takes seconds; test_launch_training.py-style
real training is left to the slower tests.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path

import pytest
from helpers.launch import HOSTS, tagged_processes
from helpers.paths import PROJECT_DIR

from textsql.arguments import train_argv
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.failures import FailureKind, killing_signal
from textsql.launching.launch_watch import LaunchWatch
from textsql.launching.recovery import SUPERVISOR_FILE, classify
from textsql.launching.supervisor import Supervisor, supervise
from textsql.launching.training_plan import TrainingPlan
from textsql.planning.train_args import parse_command_line

# A rank program: forms the gloo group; rank 1 of the first launch (no --resume-from-checkpoint yet) fails as asked.
RANK_MODULE = """
import os, signal, sys
import psutil, torch.distributed as dist
rank, mode, resumed = int(os.environ["RANK"]), os.environ["STANDIN_MODE"], "--resume-from-checkpoint" in sys.argv
dist.init_process_group("gloo")
dist.barrier()
if rank == 1 and mode == "raise":
    raise ValueError("stand-in rank 1 cannot parse its batch")
if rank == 1 and mode == "kill" and not resumed:
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1 and mode == "killpod" and not resumed:
    # A pod deleted: its agent and everything under it (sshd, this rank) at once.
    agent = next(p for p in psutil.Process().parents() if "worker.agent" in p.cmdline())
    for process in [agent, *agent.children(recursive=True)]:
        process.kill()
dist.barrier()
print(f"stand-in rank {rank} done resumed={resumed}", flush=True)
dist.destroy_process_group()
"""


def supervised(cluster, tmp_path: Path, mode: str, max_restarts: int = 3) -> tuple[int | Exception, str, dict]:
    """Run the stand-in under the supervisor on the cluster: (exit code or raised error, output, supervisor.json)."""
    directory = tmp_path / "modules"
    directory.mkdir(exist_ok=True)
    (directory / "standin_rank.py").write_text(RANK_MODULE)
    tag = uuid.uuid4().hex
    env = {"PYTHONPATH": f"{directory}{os.pathsep}{PROJECT_DIR}", "LAUNCH_TEST_TAG": tag, "STANDIN_MODE": mode}
    arguments = LaunchArguments(run_dir=cluster.run_dir, module="standin_rank", env=env)
    stream = io.StringIO()
    try:
        result: int | Exception = supervise(arguments, cluster, max_restarts=max_restarts, stream=stream)
    except LaunchError as error:
        result = error
    print(stream.getvalue()[-6000:])
    # Every decision in full, however long the output: a failure's first cause is in them.
    print("".join(line for line in stream.getvalue().splitlines(keepends=True) if line.startswith("[supervisor]")))
    assert tagged_processes(tag) == [], "ranks left behind"
    return result, stream.getvalue(), json.loads((cluster.run_dir / SUPERVISOR_FILE).read_text())


# ---- classification, no processes -------------------------------------------------------------


@pytest.mark.parametrize("code, signum", [(247, 9), (137, 9), (241, 15), (-9, 9), (1, None), (0, None), (255, None)])
def test_killing_signal_from_exit_status(code: int, signum: int | None) -> None:
    assert killing_signal(code) == signum


def watched(*lines: str) -> LaunchWatch:
    watch = LaunchWatch(io.StringIO(), list(HOSTS))
    watch.write("".join(line + "\n" for line in lines))
    return watch


def test_a_rank_killed_by_sigkill_is_a_lost_worker_even_if_its_peer_raised() -> None:
    watch = watched(
        "127.0.0.2: Traceback (most recent call last):",
        '127.0.0.2:   File "x.py", line 1',
        "127.0.0.2: RuntimeError: Connection reset by peer",
        "pdsh@m: 127.0.0.2: ssh exited with exit code 1",
        "pdsh@m: 127.0.0.3: ssh exited with exit code 247",
    )
    failure = classify(1, watch, {})
    assert (failure.kind, failure.host) == (FailureKind.WORKER_LOST, "127.0.0.3") and "SIGKILL" in failure.message


def test_a_raising_rank_is_an_application_error_with_its_exception_line() -> None:
    watch = watched(
        "127.0.0.3: Traceback (most recent call last):",
        '127.0.0.3:   File "x.py", line 1',
        "127.0.0.3: ValueError: bad batch",
        "127.0.0.3: [2025-01-01 10:00:00,000] [ERROR] [launch.py:1] exits with return code = 1",
        "pdsh@m: 127.0.0.3: ssh exited with exit code 1",
        "pdsh@m: 127.0.0.2: ssh exited with exit code 241",  # ended by us afterwards: SIGTERM is no loss
    )
    assert (
        classify(1, watch, {}) == classify(1, watch, {}) and classify(1, watch, {}).message == "ValueError: bad batch"
    )
    assert classify(1, watch, {}).kind == FailureKind.APPLICATION_ERROR
    assert classify(1, watched("pdsh@m: 127.0.0.3: ssh exited with exit code 255"), {}).kind == FailureKind.WORKER_LOST
    assert classify(1, watch, {"127.0.0.3": "pod local-1 exited"}).kind == FailureKind.WORKER_LOST


def test_the_cause_is_the_raising_rank_not_the_peer_that_lost_it_first() -> None:
    """Whichever host's failure shows first, the error named is the one that is not a lost peer."""
    watch = watched(
        "127.0.0.2: [rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:19894.",
        "pdsh@m: 127.0.0.2: ssh exited with exit code 1",
        "127.0.0.3: Traceback (most recent call last):",
        "127.0.0.3: ValueError: bad batch",
        "pdsh@m: 127.0.0.3: ssh exited with exit code 1",
    )
    failure = classify(1, watch, {})
    assert (failure.kind, failure.host, failure.message) == (
        FailureKind.APPLICATION_ERROR,
        "127.0.0.3",
        "ValueError: bad batch",
    )
    # Ranks we end after that failure may need SIGKILL on a loaded machine: still the same error.
    watch.write("pdsh@m: 127.0.0.2: ssh exited with exit code 247\n")
    assert classify(1, watch, {}).kind == FailureKind.APPLICATION_ERROR


def test_a_255_from_a_host_whose_ranks_we_ended_later_is_not_the_lost_worker() -> None:
    """ssh exits 255 when the remote processes die by signal, as ours do when we end them after a loss."""
    watch = watched(
        "127.0.0.2: [rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:11453.",
        "127.0.0.3: [2026-01-01 10:00:00,000] [ERROR] [launch.py:259:sigkill_handler] [...] exits with return code = -9",
        "pdsh@m: 127.0.0.3: ssh exited with exit code 247",
        "pdsh@m: 127.0.0.2: ssh exited with exit code 255",
    )
    failure = classify(1, watch, {})
    assert (failure.kind, failure.host) == (FailureKind.WORKER_LOST, "127.0.0.3") and "SIGKILL" in failure.message
    # A 255 that only follows a peer's lost connection is still the unreachable host.
    watch = watched(
        "127.0.0.2: [rank0]: RuntimeError: Connection closed by peer",
        "pdsh@m: 127.0.0.2: ssh exited with exit code 1",
        "pdsh@m: 127.0.0.3: ssh exited with exit code 255",
    )
    assert (classify(1, watch, {}).kind, classify(1, watch, {}).host) == (FailureKind.WORKER_LOST, "127.0.0.3")


def test_a_rank_exiting_by_itself_before_the_255_of_the_host_we_ended_is_the_application_error() -> None:
    """A rank that exits non-zero with a message and no traceback (``sys.exit("...")``): its host's exit comes first,
    and the 255 of the other host, whose ranks this side then ended, is no lost worker (nor is there a peer's error
    to blame on it)."""
    watch = watched(
        "127.0.0.3: stand-in rank 1 fails on purpose before the process group forms",
        "127.0.0.3: [2026-01-01 10:00:00,000] [ERROR] [launch.py:259:sigkill_handler] [...] exits with return code = 1",
        "pdsh@m: 127.0.0.3: ssh exited with exit code 1",
        "pdsh@m: 127.0.0.2: ssh exited with exit code 255",
    )
    failure = classify(1, watch, {})
    assert (failure.kind, failure.host, failure.message) == (
        FailureKind.APPLICATION_ERROR,
        "127.0.0.3",
        "stand-in rank 1 fails on purpose before the process group forms",
    )


def test_the_launcher_leaving_on_our_sigterm_is_not_an_application_error() -> None:
    """DeepSpeed's launch.py, ended by us after the loss, may print a SystemExit traceback from an atexit hook."""
    watch = watched(
        "127.0.0.2: [rank0]: Traceback (most recent call last):",
        "127.0.0.2: [rank0]: RuntimeError: Connection closed by peer",
        "127.0.0.3: [2026-01-01 10:00:00,000] [ERROR] [launch.py:259:sigkill_handler] [...] exits with return code = -9",
        "pdsh@m: 127.0.0.3: ssh exited with exit code 247",
        "127.0.0.2: Exception ignored in atexit callback: <bound method finalize._exitfunc>",
        "127.0.0.2: Traceback (most recent call last):",
        '127.0.0.2:   File "deepspeed/launcher/launch.py", line 266, in sigkill_handler',
        "127.0.0.2: SystemExit: 1",
        "pdsh@m: 127.0.0.2: ssh exited with exit code 1",
    )
    failure = classify(1, watch, {})
    assert (failure.kind, failure.host) == (FailureKind.WORKER_LOST, "127.0.0.3"), failure


def test_the_failure_line_names_the_step_and_the_detection_time() -> None:
    watch = watched("127.0.0.2: step 3/6: loss 9.644 (18 s)", "pdsh@m: 127.0.0.3: ssh exited with exit code 247")
    assert watch.step == 3
    line = classify(1, watch, {}).line(watch.step, 0.42)
    assert line == "worker lost at step 3 (a rank on 127.0.0.3 was killed by SIGKILL), detected after 0.4 s"
    assert (
        classify(1, watched("127.0.0.3: ValueError: x"), {})
        .line(None, 1)
        .startswith("application error before the first step")
    )


def test_a_relaunchs_resume_auto_wins_over_the_users_resume_and_overwrite(tmp_path: Path) -> None:
    """The supervisor adds its training arguments after the user's; the ranks' parser takes the last of a flag."""
    user = train_argv(data_dir=tmp_path, run_dir=tmp_path / "out", profile="zero1", overwrite_output_dir=True)
    relaunch = train_argv(resume_from_checkpoint="auto", overwrite_output_dir=False)
    _, _, run_args, training = parse_command_line([*user, *relaunch])
    assert (training["resume_from_checkpoint"], run_args.overwrite_output_dir) == ("auto", False)
    *_, training = parse_command_line(
        [
            *train_argv(data_dir=tmp_path, run_dir=tmp_path, resume_from_checkpoint="x"),
            "--resume-from-checkpoint",
            "auto",
        ]
    )
    assert training["resume_from_checkpoint"] == "auto"


@pytest.mark.parametrize(
    "batch, accumulation, first, now, expected",
    [
        (4, 1, 3, 2, {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2, "length_group_size": 4}),
        (4, 1, 3, 1, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "length_group_size": 4}),
        (8, 2, 4, 2, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "length_group_size": 16}),
        (4, 1, 3, 3, {}),
    ],
)
def test_fewer_ranks_keep_the_global_batch_and_no_rank_holds_more(batch, accumulation, first, now, expected) -> None:
    plan = TrainingPlan(Path("out"), batch, accumulation)
    overrides = plan.batch_for(first, now)
    assert overrides == expected
    if overrides:
        kept = overrides["per_device_train_batch_size"] * overrides["gradient_accumulation_steps"] * now
        assert kept == batch * accumulation * first and overrides["per_device_train_batch_size"] <= batch


def test_a_token_budget_keeps_at_most_the_tokens_of_a_step() -> None:
    overrides = TrainingPlan(Path("out"), 16, 1, max_tokens_per_batch=1000).batch_for(3, 2)
    assert overrides == {"max_tokens_per_batch": 750, "gradient_accumulation_steps": 2}
    assert TrainingPlan(Path("out"), 16, 1, max_tokens_per_batch=1000).batch_for(3, 3) == {}


def test_a_global_batch_that_does_not_divide_among_the_ranks_left_is_refused_in_one_line() -> None:
    with pytest.raises(LaunchError, match=r"global batch of 9 questions does not divide among 2 ranks; .*min_workers"):
        TrainingPlan(Path("out"), 3, 1).batch_for(3, 2)


def test_min_workers_must_be_from_one_to_the_workers(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    arguments = LaunchArguments(run_dir=tmp_path, module="standin_rank")
    for bad in (0, 3):
        with pytest.raises(LaunchError, match=rf"--min-workers {bad} must be from 1 to the number of workers \(2\)"):
            Supervisor(arguments, min_workers=bad, plan=TrainingPlan.read(arguments))
    assert Supervisor(arguments, plan=TrainingPlan.read(arguments)).min_workers == 2, (
        "the default must keep today's behaviour: never go on with fewer"
    )


# ---- real launches ----------------------------------------------------------------------------


@pytest.mark.slow
def test_rank_killed_by_sigkill_is_relaunched_on_the_same_workers(two_local_workers, tmp_path: Path) -> None:
    result, output, record = supervised(two_local_workers, tmp_path, "kill")
    assert result == 0
    assert "stand-in rank 1 done resumed=True" in output
    events = [event["event"] for event in record["events"]]
    assert events == [FailureKind.WORKER_LOST, "relaunch", "finished"]
    lost = record["events"][0]
    assert lost["host"] == "127.0.0.3" and "SIGKILL" in lost["message"]
    print(f"rank SIGKILL: detected {lost['detected_s']:.1f} s after the first failure line")


@pytest.mark.slow
def test_the_same_error_twice_ends_the_run_with_it_after_one_retry(two_local_workers, tmp_path: Path) -> None:
    result, _, record = supervised(two_local_workers, tmp_path, "raise")
    error = "ValueError: stand-in rank 1 cannot parse its batch"
    assert isinstance(result, LaunchError) and str(result) == error
    said = [(event["event"], event.get("message", event["line"])) for event in record["events"]]
    # On a loaded machine a first launch may fail for a reason of its own before the stand-in's rank raises (a
    # timeout, a port taken): another error, retried as any is. Then the rank's error, retried once, ends the run.
    first = said.index((FailureKind.APPLICATION_ERROR, error)) if (FailureKind.APPLICATION_ERROR, error) in said else -1
    assert first in (0, 2) and said[first:] == [
        (FailureKind.APPLICATION_ERROR, error),
        ("relaunch", said[first + 1][1]),
        (FailureKind.APPLICATION_ERROR, error),
        ("gave up", f"the same error twice, not retried again: {error}"),
    ], said


@pytest.mark.slow
def test_a_deleted_pod_is_replaced_and_the_run_finishes(two_local_workers, tmp_path: Path) -> None:
    old_key = (two_local_workers.run_dir / "known_hosts").read_text()
    result, output, record = supervised(two_local_workers, tmp_path, "killpod")
    assert result == 0, output[-3000:]
    events = [event["event"] for event in record["events"]]
    assert events == [FailureKind.WORKER_LOST, "replaced", "relaunch", "finished"]
    assert record["events"][0]["host"] == "127.0.0.3"
    new_key = (two_local_workers.run_dir / "known_hosts").read_text()
    assert new_key != old_key, "the replacement's new host key was not pinned"
    assert "stand-in rank 1 done resumed=True" in output
    assert any(pod.pod == "local-1-r1" for pod in two_local_workers.backend.pods)
