"""A hostfile's hosts under the supervisor: a lost host is waited for, then dropped when --min-workers allows.

The fast tests drive :meth:`Supervisor.recover` over :class:`HostfileHosts` whose ssh answers are scripted on a
fake clock (when each host is back); the rest is real: the hostfiles written, the events, the errors. The slow
test is `textsql launch --hostfile` over two real `local` worker pods, one of them killed after a checkpoint.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.launch import tagged_processes, textsql_launch

from bench.recovery import TAG_VAR, StepStream, kill_after, kill_pod, supervised_arguments
from textsql.constants import RUN_SUMMARY_NAME
from textsql.launching.command import LaunchArguments
from textsql.launching.failures import Failure, FailureKind
from textsql.launching.hostfile_hosts import REMAINING_HOSTFILE_NAME, HostfileHosts
from textsql.launching.recovery import SUPERVISOR_FILE
from textsql.launching.supervisor import Supervisor
from textsql.launching.training_plan import TrainingPlan
from worker.errors import WorkerError
from worker.network import free_port

HOSTFILE = "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"
LOST = Failure(FailureKind.WORKER_LOST, "127.0.0.3", 255, "ssh to 127.0.0.3 failed (exit code 255)")


class FakeClock:
    """Time that passes only when slept."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@dataclass(frozen=True)
class ScriptedHosts(HostfileHosts):
    """Hosts whose ssh answers from ``back_at`` (host -> the fake time it answers again; absent: always)."""

    back_at: dict[str, float] = field(default_factory=dict)
    probes: list[tuple[str, float]] = field(default_factory=list)

    def answers(self, host: str, timeout: float = 15.0) -> bool:
        self.probes.append((host, self.clock()))
        return self.clock() >= self.back_at.get(host, -math.inf)


def supervisor(tmp_path: Path, min_workers: int, back_at: float, replace_timeout: float = 30) -> Supervisor:
    """A supervisor of a stand-in launch over a two-host hostfile of the user's, 127.0.0.3 back at ``back_at``."""
    (tmp_path / "hosts").write_text(HOSTFILE)
    arguments = LaunchArguments(run_dir=tmp_path / "run", hostfile=tmp_path / "hosts", module="standin")
    arguments.run_dir.mkdir()
    clock = FakeClock()
    read = HostfileHosts.read(arguments)
    hosts = ScriptedHosts(
        read.run_dir, read.hostfile, read.slots, clock=clock, sleep=clock.sleep, back_at={"127.0.0.3": back_at}
    )
    return Supervisor(
        arguments,
        hosts,
        replace_timeout=replace_timeout,
        min_workers=min_workers,
        stream=io.StringIO(),
        plan=TrainingPlan.read(arguments),
    )


def test_a_hostfile_run_supervises_its_hosts_without_a_cluster(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text(HOSTFILE)
    arguments = LaunchArguments(run_dir=tmp_path, module="standin")
    hosts = Supervisor(arguments, plan=TrainingPlan.read(arguments)).hosts
    assert isinstance(hosts, HostfileHosts) and hosts.hosts == ["127.0.0.2", "127.0.0.3"]
    assert hosts.hostfile == (tmp_path / "hostfile").resolve()


def test_a_host_that_answers_at_once_is_reused_without_waiting(tmp_path: Path) -> None:
    run = supervisor(tmp_path, min_workers=1, back_at=0)
    run.recover(LOST, 0)
    assert run.hosts.probes == [("127.0.0.3", 0.0)] and run.events == []
    assert not (run.arguments.run_dir / REMAINING_HOSTFILE_NAME).exists()


def test_a_host_back_within_the_timeout_is_relaunched_on(tmp_path: Path) -> None:
    run = supervisor(tmp_path, min_workers=1, back_at=12)
    run.recover(LOST, 0)
    assert [event["event"] for event in run.events] == ["replaced"]
    assert run.events[0]["line"].startswith("host 127.0.0.3 answers ssh again after "), "said a replacement came"
    assert run.hosts.clock() == 15, "not asked again every 5 s until it answered"
    assert run.hosts.hosts == ["127.0.0.2", "127.0.0.3"]
    assert run.arguments.hostfile == (tmp_path / "hosts").resolve()


def test_a_host_not_back_in_time_is_dropped_when_min_workers_allows(tmp_path: Path) -> None:
    run = supervisor(tmp_path, min_workers=1, back_at=31)
    run.recover(LOST, 0)
    assert run.hosts.clock() == 30, "waited other than --replace-timeout"
    remaining = tmp_path / "run" / REMAINING_HOSTFILE_NAME
    assert remaining.read_text() == "127.0.0.2 slots=1\n"
    assert oct(remaining.stat().st_mode & 0o777) == "0o600"
    assert (tmp_path / "hosts").read_text() == HOSTFILE, "the user's hostfile was changed"
    assert run.arguments.hostfile == remaining.resolve() and run.hosts.hosts == ["127.0.0.2"]
    (shrunk,) = run.events
    assert (shrunk["event"], shrunk["world_size_before"], shrunk["world_size_after"]) == ("shrunk", 2, 1)
    assert shrunk["line"].startswith("worker 127.0.0.3 lost, no replacement after ")
    assert shrunk["line"].endswith(
        "; going on with 1 worker from the start; "
        f"the hosts left are in {remaining.resolve()} ({(tmp_path / 'hosts').resolve()} unchanged)"
    )
    # The global batch of the two ranks is kept on one.
    assert shrunk["overrides"]["gradient_accumulation_steps"] == 2
    assert json.loads((tmp_path / "run" / SUPERVISOR_FILE).read_text())["events"][0]["event"] == "shrunk"


def test_a_host_not_back_in_time_ends_the_run_naming_min_workers(tmp_path: Path) -> None:
    run = supervisor(tmp_path, min_workers=2, back_at=math.inf, replace_timeout=7)
    with pytest.raises(WorkerError) as raised:
        run.recover(LOST, 0)
    assert str(raised.value) == (
        f"lost host 127.0.0.3 of {(tmp_path / 'hosts').resolve()} did not answer ssh again within 7s; check the "
        "host and its sshd; going on without it would leave 1 worker(s), fewer than --min-workers 2 "
        "(lower it to go on with fewer)"
    )
    assert run.hosts.clock() == 7 and run.hosts.clock.slept == [5, 2]
    assert not (tmp_path / "run" / REMAINING_HOSTFILE_NAME).exists()


def test_a_host_without_sshd_does_not_answer_real_ssh(tmp_path: Path) -> None:
    """Real ssh, to a port nothing listens on: refused at once."""
    (tmp_path / "hostfile").write_text("127.0.0.9 slots=1\n")
    hosts = HostfileHosts.read(LaunchArguments(run_dir=tmp_path, ssh_port=free_port()))
    assert not hosts.answers("127.0.0.9", timeout=10)
    with pytest.raises(WorkerError, match="did not answer ssh again within 0s"):
        hosts.replace_worker("127.0.0.9", timeout=0)
    with pytest.raises(WorkerError, match="is the run's last host"):
        hosts.without_worker("127.0.0.9")
    with pytest.raises(WorkerError, match=r"127\.0\.0\.4 is not a host of "):
        hosts.without_worker("127.0.0.4")


# ---- `textsql launch --hostfile` over real worker pods -------------------------------------------------

MAX_STEPS, SAVE_STEPS = 4, 2
REPLACE_TIMEOUT_S = 5
SHRUNK = [FailureKind.WORKER_LOST, "shrunk", "relaunch", "resumed", "finished"]


@pytest.mark.slow
@pytest.mark.parametrize("min_workers", [1, 2])
def test_a_lost_host_of_a_hostfile_is_left_behind_or_ends_the_run(
    two_local_workers, train_data, tmp_path, min_workers
) -> None:
    """The pod of 127.0.0.3 (its sshd and ranks) is killed once checkpoint-2 is complete and step 3 logged."""
    run_dir, output, tag, killed = two_local_workers.run_dir, tmp_path / "out", uuid.uuid4().hex, {}
    hostfile = Path(shutil.copy(run_dir / "hostfile", tmp_path / "hosts"))
    train_args = supervised_arguments(
        train_data, output, tag, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, per_device_train_batch_size=4
    ).train_args
    command = textsql_launch(
        output,
        *("--hostfile", str(hostfile), "--ssh-config", str(run_dir / "ssh_config"), "--max-restarts", "1"),
        *("--min-workers", str(min_workers), "--replace-timeout", str(REPLACE_TIMEOUT_S)),
        env={TAG_VAR: tag},
    )
    stream = StepStream(tmp_path / "output.log")
    killer = kill_after(stream, SAVE_STEPS + 1, output / f"checkpoint-{SAVE_STEPS}", tag, killed, kill=kill_pod)
    process = subprocess.Popen(
        [*command, "--", *train_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    reader = threading.Thread(target=lambda: [stream.write(line) for line in process.stdout], daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=900)
    finally:
        process.kill()
        reader.join(timeout=10)
        stream.close()
        print(stream.text[-8000:])
    killer.join(timeout=5)
    assert "at" in killed, killed
    assert tagged_processes(tag) == [], "ranks left behind"
    assert hostfile.read_text() == HOSTFILE, "the user's hostfile was changed"
    events = json.loads((output / SUPERVISOR_FILE).read_text())["events"]
    assert events[0]["event"] == FailureKind.WORKER_LOST and events[0]["host"] == "127.0.0.3", events[0]
    remaining = output / REMAINING_HOSTFILE_NAME
    if min_workers == 2:
        assert code == 1
        assert stream.text.rstrip().splitlines()[-1] == (
            f"Error: lost host 127.0.0.3 of {hostfile.resolve()} did not answer ssh again within "
            f"{REPLACE_TIMEOUT_S}s; check the host and its sshd; "
            "going on without it would leave 1 worker(s), fewer than --min-workers 2 (lower it to go on with fewer)"
        )
        assert not remaining.exists()
        return
    assert code == 0
    assert [event["event"] for event in events] == SHRUNK
    shrunk = events[1]
    assert (shrunk["world_size_before"], shrunk["world_size_after"]) == (2, 1)
    assert f"no replacement after {REPLACE_TIMEOUT_S}." in shrunk["line"]
    assert f"going on with 1 worker from checkpoint-{SAVE_STEPS} (converted in " in shrunk["line"]
    assert remaining.read_text() == "127.0.0.2 slots=1\n" and shrunk["hostfile"] == str(remaining.resolve())
    summary = json.loads((output / RUN_SUMMARY_NAME).read_text())
    assert summary["global_step"] == MAX_STEPS and summary["world_size"] == 1
    assert Path(summary["resumed_from"]).name == f"checkpoint-{SAVE_STEPS}"
    print(f"hostfile run shrunk: {shrunk['line']}")
