"""The ``slurm`` backend against a real Slurm: munged, slurmctld and two slurmd on this machine
(tests/helpers/slurm.py), each worker one batch job whose agent registers over the real rendezvous.

The quick tests check the options and the refusals that need no cluster.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from helpers.paths import PROJECT_DIR
from helpers.slurm import NODES

from textsql.cli import cli
from worker import constants as c
from worker.backends import make_backend
from worker.backends.slurm import SlurmBackend, cleanup
from worker.backends.slurm_node import agent_environment
from worker.backends.slurm_options import SlurmOptions, time_limit_seconds
from worker.cluster import start_workers
from worker.errors import RendezvousError, WorkerError

# Both workers submitted, running and registered: about 4 s here; generous for a loaded 2-core machine.
REGISTER_BOUND_S = 60
# A master that holds two Slurm workers until it is interrupted.
HOLDING_MASTER = """
import sys, time
from worker.cluster import start_workers
with start_workers("slurm", 2, sys.argv[1], timeout=60, ssh_port=0) as cluster:
    print("registered", flush=True)
    time.sleep(600)
"""


def test_extra_sbatch_flags_outside_the_allow_list_are_refused_in_one_line():
    with pytest.raises(WorkerError, match=r"^sbatch flag '--export=NONE' is not allowed in sbatch_flags; use --flag"):
        SlurmOptions(sbatch_flags=["--export=NONE"])
    with pytest.raises(WorkerError, match="must be a list"):
        SlurmOptions(sbatch_flags="--qos=high")
    options = SlurmOptions(
        partition="gpu", account="ml", time_limit="1:00:00", gpus_per_node=4, sbatch_flags=["--qos=high"]
    )
    assert options.sbatch_arguments(gpus=0) == [
        "--exclusive",
        "--partition=gpu",
        "--account=ml",
        "--time=1:00:00",
        "--gres=gpu:4",
        "--qos=high",
    ]


def test_a_time_limit_shorter_than_the_runs_estimate_is_refused_before_submitting():
    assert [time_limit_seconds(t) for t in ("90", "1:30", "2:00:00", "1-00", "1-2:03:04")] == [
        5400,
        90,
        7200,
        86400,
        93784,
    ]
    with pytest.raises(WorkerError, match=r"time_limit '30' \(1800 s\) is shorter than the run's estimate \(3600 s\)"):
        make_backend("slurm", time_limit="30", min_time_s=3600)
    with pytest.raises(WorkerError, match="not a Slurm time"):
        SlurmOptions(time_limit="an hour")


def test_no_sbatch_on_path_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(WorkerError, match=r"^sbatch is not on PATH; run on a Slurm login node"):
        SlurmBackend(SlurmOptions()).check(2, 0)


def test_preflight_says_sbatch_is_missing_for_slurm_workers_only(tmp_path, monkeypatch):
    from textsql.launching.preflight import check_runtime

    monkeypatch.setenv("PATH", str(tmp_path))
    lines = [check.line() for check in check_runtime("default", "sample", "slurm", 0) if check.name == "sbatch"]
    assert (
        len(lines) == 1
        and "sbatch is not installed (submits the worker jobs); run the notebooks on a Slurm" in lines[0]
    )
    assert not [check for check in check_runtime("default", "sample", "local", 0) if check.name == "sbatch"]


@pytest.mark.slow
def test_bad_partition_node_count_and_gres_are_refused_from_sinfo(slurm_cluster):
    with pytest.raises(WorkerError, match=r"no Slurm partition 'gpu'; set partition to one of debug"):
        SlurmBackend(SlurmOptions(partition="gpu")).check(2, 0)
    with pytest.raises(WorkerError, match=r"3 workers need 3 nodes but partition 'debug' has 2"):
        SlurmBackend(SlurmOptions()).check(3, 0)
    with pytest.raises(
        WorkerError, match=r"1 GPUs per worker, but the nodes of partition 'debug' have at most 0 \(gres: none\)"
    ):
        SlurmBackend(SlurmOptions()).check(2, 1)
    assert slurm_cluster.jobs() == []


@pytest.mark.slow
def test_a_job_on_a_loopback_node_gives_its_agent_the_nodes_address_and_gpus(slurm_cluster):
    """Nodes emulated on one host differ only in their NodeAddr: the agent must register that, not lo's 127.0.0.1."""
    env = agent_environment({"SLURMD_NODENAME": "node2", "SLURM_GPUS_ON_NODE": "4"})
    assert (env[c.ENV_ADDRESS], env[c.ENV_SLOTS]) == (NODES["node2"], "4")
    assert agent_environment({"SLURMD_NODENAME": "no-such-node"}) == {
        "SLURMD_NODENAME": "no-such-node",
        c.ENV_SLOTS: "1",
    }


@pytest.mark.slow
def test_two_workers_register_from_their_nodes_and_leave_nothing_in_the_queue(slurm_cluster, tmp_path):
    started = time.monotonic()
    with start_workers("slurm", 2, tmp_path / "run", timeout=REGISTER_BOUND_S, ssh_port=0) as cluster:
        registered_s = time.monotonic() - started
        assert sorted(cluster.hosts) == sorted(NODES.values())
        assert len(slurm_cluster.jobs()) == 2 and all(" RUNNING" in job for job in slurm_cluster.jobs())
        for host in cluster.hosts:  # the pinned host key, through the run's own ssh_config
            result = cluster.ssh(host, "echo reached")
            assert result.returncode == 0 and result.stdout == "reached\n", result.stderr
        assert cluster.hostfile.parent != cluster.run_dir, "the token and keys stay off the shared run dir"
    print(json.dumps({"submit_to_registered_s": round(registered_s, 2)}))
    assert slurm_cluster.jobs() == []


@pytest.mark.slow
def test_a_job_whose_script_fails_names_slurms_reason_and_its_logs_last_line(slurm_cluster, tmp_path):
    missing = tmp_path / "no-such-python"
    started = time.monotonic()
    # Seen by the job's wait or by the rendezvous's, whichever looks first.
    backend = SlurmBackend(SlurmOptions(), str(missing))
    with (
        pytest.raises((WorkerError, RendezvousError)) as raised,
        start_workers(backend, 1, tmp_path / "run", timeout=REGISTER_BOUND_S),
    ):
        pass
    message = str(raised.value)
    # Slurm's state when the backend looked: FAILED, or COMPLETING while slurmd still cleans the job up (a look
    # inside that moment failed a suite run once); its reason says the script failed either way.
    assert "\n" not in message and re.search(
        r"job [0-9]+ ended (FAILED|COMPLETING) \(NonZeroExitCode\) on node[12]: ", message
    ), message
    assert f"{missing}: not found" in message, message
    assert time.monotonic() - started < REGISTER_BOUND_S / 2, (
        "the failure is seen when the job ends, not at the timeout"
    )


@pytest.mark.slow
def test_a_pending_job_says_why_and_is_cancelled_at_the_timeout(slurm_cluster, tmp_path, caplog):
    blocker = slurm_cluster.run(
        "sbatch", "--parsable", "--exclusive", "--nodelist=node2", "--output=/dev/null", "--wrap=sleep 300"
    ).strip()
    caplog.set_level(logging.WARNING, logger="worker.backends.slurm")
    started = time.monotonic()
    with pytest.raises(WorkerError) as raised, start_workers("slurm", 2, tmp_path / "run", timeout=8, ssh_port=0):
        pass
    message = str(raised.value)
    assert "\n" not in message and "still pending after 8s" in message and "Resources" in message, message
    assert "cancelled them" in message
    pending = [r.getMessage() for r in caplog.records if "is pending: Resources" in r.getMessage()]
    assert pending and pending[0].startswith("Slurm job "), caplog.text
    reported_s = min(r.created for r in caplog.records if "is pending" in r.getMessage()) - (
        time.time() - (time.monotonic() - started)
    )
    assert reported_s < 5, f"the reason came {reported_s:.1f} s after submitting"
    assert [job.split()[0] for job in slurm_cluster.jobs()] == [blocker]


@pytest.mark.slow
def test_workers_cleanup_cancels_the_jobs_a_dead_kernel_left(slurm_cluster, tmp_path):
    backend = SlurmBackend(SlurmOptions())
    context = start_workers(backend, 2, tmp_path / "run", timeout=REGISTER_BOUND_S, ssh_port=0)
    context.__enter__()  # a kernel that dies here never leaves the block
    try:
        other = slurm_cluster.run(
            "sbatch", "--parsable", "--job-name=textsql-other-0", "--output=/dev/null", "--wrap=sleep 300"
        ).strip()
        ours = sorted(job.split()[0] for job in slurm_cluster.jobs() if backend.run_id in job)
        assert len(ours) == 2
        result = CliRunner().invoke(cli, ["workers", "cleanup", "--backend", "slurm", "--run", backend.run_id])
        assert result.exit_code == 0 and result.output == f"cancelled 2 Slurm jobs: {' '.join(ours)}\n", result.output
        assert cleanup(None) == [other]  # every textsql run's
        deadline = time.monotonic() + 30
        while slurm_cluster.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert slurm_cluster.jobs() == []
    finally:
        context.__exit__(None, None, None)


@pytest.mark.slow
def test_an_interrupted_master_cancels_its_jobs(slurm_cluster, tmp_path):
    master = subprocess.Popen(
        [sys.executable, "-c", HOLDING_MASTER, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(PROJECT_DIR)},
    )
    try:
        assert master.stdout is not None and master.stdout.readline() == "registered\n"
        assert len(slurm_cluster.jobs()) == 2
        master.send_signal(signal.SIGINT)  # Ctrl-C
        master.wait(timeout=60)
    finally:
        master.kill()
        master.wait()
    assert slurm_cluster.jobs() == []
