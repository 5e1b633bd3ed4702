"""The collective check before the first training step (textsql/training/collective.py), on real gloo ranks
launched over pdsh on two `local` worker pods with a stand-in rank program (as tests/test_supervise.py does),
or as two plain processes whose ssh session names their host (the slow-host rule)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from textsql.constants import COLLECTIVE_FILE_NAME
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.supervisor import supervise
from textsql.training.collective import HOLD_VAR, SIZES, SLOW_MIN_S, SLOW_VAR, TIMEOUT_VAR, figures
from worker.network import free_port

PROJECT_DIR = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)

# Forms the gloo group as the trainer's distributed state does, then runs the check as train.main does.
RANK_MODULE = """
import sys
import torch.distributed as dist
from textsql.training.collective import exit_on_failure
dist.init_process_group("gloo")
result = exit_on_failure(sys.argv[sys.argv.index("--run_dir") + 1])
print(f"collective ok on rank {dist.get_rank()}: hosts {result['hosts']}", flush=True)
dist.destroy_process_group()
"""


def run_check(cluster, tmp_path: Path, **env: str) -> tuple[int | Exception, str]:
    modules = tmp_path / "modules"
    modules.mkdir(exist_ok=True)
    (modules / "collective_standin.py").write_text(RANK_MODULE)
    rank_env = {"PYTHONPATH": f"{modules}{os.pathsep}{PROJECT_DIR}", **env}
    arguments = LaunchArguments(
        run_dir=cluster.run_dir,
        module="collective_standin",
        env=rank_env,
        train_args=["--run_dir", str(cluster.run_dir)],
    )
    stream = io.StringIO()
    try:
        result: int | Exception = supervise(arguments, cluster, max_restarts=0, stream=stream)
    except LaunchError as error:
        result = error
    return result, stream.getvalue()


@pytest.mark.slow
def test_every_rank_all_reduces_and_rank_0_records_bus_bandwidth_per_size(two_local_workers, tmp_path):
    result, output = run_check(two_local_workers, tmp_path)
    assert result == 0, output[-3000:]
    assert "127.0.0.3: collective ok on rank 1: hosts ['127.0.0.2', '127.0.0.3']" in output
    recorded = json.loads((two_local_workers.run_dir / COLLECTIVE_FILE_NAME).read_text())
    assert recorded["world_size"] == 2 and recorded["backend"] == "gloo"
    assert recorded["hosts"] == ["127.0.0.2", "127.0.0.3"]
    assert [size["bytes"] for size in recorded["sizes"]] == [4 * elements for elements in SIZES]
    assert all(size["bus_gbps"] > 0 for size in recorded["sizes"])
    assert [host["host"] for host in recorded["per_host"]] == ["127.0.0.2", "127.0.0.3"]
    assert all(host["result"] == "ok" and len(host["sizes"]) == len(SIZES) for host in recorded["per_host"])
    assert recorded["slow_hosts"] == []


@pytest.mark.slow
def test_a_host_whose_all_reduce_cannot_complete_stops_the_run_before_training_naming_it(two_local_workers, tmp_path):
    result, output = run_check(two_local_workers, tmp_path, **{HOLD_VAR: "127.0.0.3=600", TIMEOUT_VAR: "5"})
    assert result != 0, output[-3000:]
    assert (
        "127.0.0.2: CollectiveError: all-reduce 1 of 3 did not complete within 5 s; never joined: rank 1 on 127.0.0.3"
        in output
    ), output[-3000:]
    assert "collective ok" not in output
    assert not (two_local_workers.run_dir / COLLECTIVE_FILE_NAME).exists()


def test_a_host_the_others_wait_for_on_every_all_reduce_is_slow():
    def timings(late: list[float]) -> list[list[tuple[float, float]]]:
        # Rank 1 joins `late` s after the start; rank 0 waits that long plus the all-reduce's own 0.01 s.
        return [[(0.0, wait + 0.01), (wait, 0.01)] for wait in late]

    slow = figures(["a", "b"], timings([2.0, 2.1, 2.0]), "gloo")
    assert [host["host"] for host in slow["slow_hosts"]] == ["b"]
    assert [host["result"] for host in slow["per_host"]] == ["ok", "slow"]
    assert slow["per_host"][1]["waited_for_s"] == [2.0, 2.1, 2.0] and slow["per_host"][0]["waited_for_s"] == [0, 0, 0]
    assert [size["seconds"] for size in slow["sizes"]] == [0.01] * 3  # the all-reduce's own time, not the wait
    # Once late (a hiccup) is not slow, nor a wait under the floor however many times the all-reduce it is.
    assert figures(["a", "b"], timings([2.0, 0.0, 0.0]), "gloo")["slow_hosts"] == []
    assert figures(["a", "b"], timings([SLOW_MIN_S / 2] * 3), "gloo")["slow_hosts"] == []


# Two ranks as two processes; SSH_CONNECTION names the host each reached, as pdsh's ssh session would.
STANDIN = """
import sys
import torch.distributed as dist
from textsql.training.collective import exit_on_failure
dist.init_process_group("gloo")
exit_on_failure(sys.argv[1])
print("collective ok", flush=True)
"""


@pytest.mark.slow
def test_a_slowed_host_stops_the_check_naming_it(tmp_path):
    port = str(free_port())
    ranks = []
    for rank, host in enumerate(("127.0.0.2", "127.0.0.3")):
        env = os.environ | {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "GLOO_SOCKET_IFNAME": "lo",
            "SSH_CONNECTION": f"127.0.0.1 50000 {host} 22",
            "PYTHONPATH": str(PROJECT_DIR),
            SLOW_VAR: f"127.0.0.3={SLOW_MIN_S * 1.5}",
        }
        command = [sys.executable, "-c", STANDIN, str(tmp_path)]
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [1, 1], outputs
    for output in outputs:
        assert "CollectiveError: 127.0.0.3 is slow: the other hosts waited 1.5 s for it on every all-reduce" in output
        assert "collective ok" not in output
    recorded = json.loads((tmp_path / COLLECTIVE_FILE_NAME).read_text())
    assert [slow["host"] for slow in recorded["slow_hosts"]] == ["127.0.0.3"]
    assert [host["host"] for host in recorded["per_host"]] == ["127.0.0.2", "127.0.0.3"]
