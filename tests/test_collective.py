"""The collective check before the first training step (textsql/training/collective.py), on real gloo ranks
launched over pdsh on two `local` worker pods with a stand-in rank program (as tests/test_supervise.py does)."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest

from textsql.constants import COLLECTIVE_FILE_NAME
from textsql.errors import LaunchError
from textsql.launching.command import LaunchArguments
from textsql.launching.supervisor import supervise
from textsql.training.collective import HOLD_VAR, SIZES, TIMEOUT_VAR

pytestmark = pytest.mark.slow
PROJECT_DIR = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)

# Forms the gloo group as the trainer's distributed state does, then runs the check as train.main does.
RANK_MODULE = """
import sys
import torch.distributed as dist
from textsql.training.collective import exit_on_failure
dist.init_process_group("gloo")
result = exit_on_failure(sys.argv[sys.argv.index("--output_dir") + 1])
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
        train_args=["--output_dir", str(cluster.run_dir)],
    )
    stream = io.StringIO()
    try:
        result: int | Exception = supervise(arguments, cluster, max_restarts=0, stream=stream)
    except LaunchError as error:
        result = error
    return result, stream.getvalue()


def test_every_rank_all_reduces_and_rank_0_records_bus_bandwidth_per_size(two_local_workers, tmp_path):
    result, output = run_check(two_local_workers, tmp_path)
    assert result == 0, output[-3000:]
    assert "127.0.0.3: collective ok on rank 1: hosts ['127.0.0.2', '127.0.0.3']" in output
    recorded = json.loads((two_local_workers.run_dir / COLLECTIVE_FILE_NAME).read_text())
    assert recorded["world_size"] == 2 and recorded["backend"] == "gloo"
    assert recorded["hosts"] == ["127.0.0.2", "127.0.0.3"]
    assert [size["bytes"] for size in recorded["sizes"]] == [4 * elements for elements in SIZES]
    assert all(size["bus_gbps"] > 0 for size in recorded["sizes"])


def test_a_host_whose_all_reduce_cannot_complete_stops_the_run_before_training_naming_it(two_local_workers, tmp_path):
    result, output = run_check(two_local_workers, tmp_path, **{HOLD_VAR: "127.0.0.3=600", TIMEOUT_VAR: "5"})
    assert result != 0, output[-3000:]
    assert (
        "127.0.0.2: CollectiveError: all-reduce 1 of 3 did not complete within 5 s; never joined: rank 1 on 127.0.0.3"
        in output
    ), output[-3000:]
    assert "collective ok" not in output
    assert not (two_local_workers.run_dir / COLLECTIVE_FILE_NAME).exists()
