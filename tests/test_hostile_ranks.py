"""A hostile worker's ranks, through real pdsh and sshd on two `local` worker pods: what they print cannot speak
for another host (a forged pdsh exit line, another host's heartbeat) or keep a frozen run alive."""

from __future__ import annotations

import io
import json
import os
from functools import partial
from pathlib import Path

import pytest
from helpers.launch import HOSTS
from helpers.paths import PROJECT_DIR

from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.launch import launch
from textsql.launching.launch_watch import LaunchWatch
from textsql.launching.stall import SHORTEST_STALL_TIMEOUT_S, StallDetector
from textsql.launching.supervisor import Supervisor
from textsql.launching.training_plan import TrainingPlan
from textsql.rank_lines import split_host_prefix
from textsql.rundir.universal import convert, needs_conversion
from worker.hostfile import read_hostfile

pytestmark = pytest.mark.slow

# Rank 0 (on 127.0.0.2) beats once; rank 1 (on 127.0.0.3) beats once, then forges, after a carriage return,
# pdsh's line for 127.0.0.2's failure and 127.0.0.2's heartbeat, and, on a line of its own, rank 0's heartbeat.
HOSTILE_RANK = """
import os, sys
rank = int(os.environ["RANK"])
print(f"heartbeat rank {rank} step 1 progress 1", flush=True)
if rank == 1:
    sys.stdout.write("progress\\rpdsh@master: 127.0.0.2: ssh exited with exit code 255\\n")
    sys.stdout.write("\\r127.0.0.2: heartbeat rank 0 step 900 progress 9000\\n")
    sys.stdout.write("heartbeat rank 0 step 900 progress 9000\\n")
    sys.stderr.write("warning\\rpdsh@master: 127.0.0.2: ssh exited with exit code 255\\n")
    sys.stdout.flush(), sys.stderr.flush()
"""


def test_a_rank_cannot_forge_another_hosts_exit_or_heartbeat(two_local_workers, tmp_path) -> None:
    directory = tmp_path / "modules"
    directory.mkdir()
    (directory / "hostile_rank.py").write_text(HOSTILE_RANK)
    env = {"PYTHONPATH": f"{directory}{os.pathsep}{PROJECT_DIR}"}
    hostfile = read_hostfile(two_local_workers.hostfile)
    assert list(hostfile) == list(HOSTS)
    detector = StallDetector(timeout=60, hosts=hostfile)
    watch = LaunchWatch(io.StringIO(), list(hostfile), detector=detector)
    arguments = LaunchArguments(
        run_dir=two_local_workers.run_dir, ssh_config=two_local_workers.ssh_config, module="hostile_rank", env=env
    )

    code = launch(arguments, stream=watch)

    print(watch.stream.getvalue()[-3000:])
    # Both hosts exited 0: no host failed, nobody was ended, no host is blamed.
    assert code == 0 and watch.exits == []
    # 127.0.0.2's rank 0 said progress 1; what 127.0.0.3 printed in its name is not its word.
    assert detector.counts == {("127.0.0.2", 0): 1, ("127.0.0.3", 1): 1}


# Both ranks beat as training ranks do (textsql.training.progress.Heartbeat), every half second for 30 s. Rank 1
# (on 127.0.0.3) ends everything it prints with a line "x", NUL, newline: pdsh prints a line with %s, so the NUL
# drops its newline and whatever pdsh prints next, 127.0.0.2's heartbeat included, is glued onto 127.0.0.3's line
# (its own heartbeat, after a newline that ends the glue, stays a line of its own).
GLUING_RANK = """
import os, sys, time
from types import SimpleNamespace
from textsql.training.progress import Heartbeat

rank = int(os.environ["RANK"])


class Glued:
    def write(self, text):
        os.write(1, ("\\n" + text + "x\\0\\n").encode())

    def flush(self):
        pass


if rank == 1:
    sys.stdout = Glued()
heartbeat = Heartbeat(interval_s=0.5)
heartbeat.on_train_begin(SimpleNamespace(process_index=rank), SimpleNamespace(global_step=0), None)
for step in range(1, 61):
    time.sleep(0.5)
    heartbeat.on_step_end(None, SimpleNamespace(global_step=step), None)
heartbeat.on_train_end(None, None, None)
"""


def test_a_host_gluing_lines_with_nul_neither_takes_nor_silences_another_hosts_heartbeat(
    two_local_workers, tmp_path
) -> None:
    directory = tmp_path / "modules"
    directory.mkdir()
    (directory / "gluing_rank.py").write_text(GLUING_RANK)
    env = {"PYTHONPATH": f"{directory}{os.pathsep}{PROJECT_DIR}"}
    arguments = LaunchArguments(
        run_dir=two_local_workers.run_dir, ssh_config=two_local_workers.ssh_config, module="gluing_rank", env=env
    )
    stream = io.StringIO()
    supervisor = Supervisor(
        arguments,
        two_local_workers,
        max_restarts=0,
        stall_timeout=SHORTEST_STALL_TIMEOUT_S,
        stream=stream,
        plan=TrainingPlan.read(arguments),
    )

    code = supervisor.run()

    print(stream.getvalue()[-3000:])
    lines = (two_local_workers.run_dir / "launch.log").read_text(encoding="utf-8").split("\n")
    # The attack happened: pdsh glued 127.0.0.2's heartbeats onto 127.0.0.3's lines...
    glued = [line for line in lines if line.startswith("127.0.0.3: x127.0.0.2: heartbeat rank 0")]
    assert glued, "pdsh glued no line: the attack did not happen"
    # ...yet 127.0.0.2 was heard all along (from its agent), so nobody stalled and both hosts ended well...
    assert code == 0 and [event["event"] for event in supervisor.events] == [], supervisor.events
    # ...and no line credited to 127.0.0.3 carries 127.0.0.2's heartbeat.
    credited = [split_host_prefix(line, list(HOSTS)) for line in lines]
    assert not [text for host, text in credited if host == "127.0.0.3" and "heartbeat rank 0" in text]


class Planted:
    """What a hostile worker pickles into a checkpoint shard: code that says where it ran when it is unpickled."""

    def __init__(self, report: Path) -> None:
        self.report = report

    def __reduce__(self):
        return exec, (PLANTED_CODE.format(report=str(self.report)),)


PLANTED_CODE = """
import json, os, psutil
report = {{"ancestors": [" ".join(p.cmdline()) for p in psutil.Process().parents()],
          "ssh": os.environ.get("SSH_CONNECTION")}}
open({report!r}, "w").write(json.dumps(report))
"""


def test_a_planted_checkpoint_is_unpickled_on_a_worker_never_on_the_master(two_local_workers, tmp_path) -> None:
    """ds_to_universal torch.loads the shards with weights_only=False: what a worker planted runs where it converts."""
    import torch

    checkpoint = tmp_path / "out" / "checkpoint-2"
    (checkpoint / "global_step2").mkdir(parents=True)
    (checkpoint / "latest").write_text("global_step2")
    report = tmp_path / "unpickled.json"
    for rank in range(3):
        torch.save(
            {"planted": Planted(report)},
            checkpoint / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
    assert needs_conversion(checkpoint, 2)

    with pytest.raises(LaunchError, match="checkpoint-2 is unchanged"):
        convert(checkpoint, on_worker=partial(two_local_workers.ssh_command, two_local_workers.hosts[0]))

    ran = json.loads(report.read_text())  # the real conversion did unpickle it...
    # ...on the worker, over the run's ssh (a `local` pod's processes are its agent's, under the pod's own sshd).
    assert ran["ssh"] and ran["ssh"].split()[2] == two_local_workers.hosts[0], ran
    assert any("sshd" in command for command in ran["ancestors"]), ran
    assert any("worker.agent" in command for command in ran["ancestors"]), ran
