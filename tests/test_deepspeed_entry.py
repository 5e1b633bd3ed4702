"""textsql.launching.deepspeed_entry: DeepSpeed's launcher programs run as DeepSpeed runs them, without MLflow."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers.launch import HOSTS

from textsql.launching.command import LaunchArguments, deepspeed_command
from textsql.launching.deepspeed_entry import ENTRY_MODULE, through_entry


@pytest.mark.parametrize("program", ["deepspeed.launcher.runner", "deepspeed.launcher.launch"])
def test_deepspeeds_programs_run_here_without_importing_mlflow(program: str) -> None:
    """Each parses its own arguments (``--help`` prints its usage and exits 0), and MLflow, which DeepSpeed's
    autotuner imports when installed, is never imported: 1.45 CPU-s of every runner's start on 2 cores."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", ENTRY_MODULE, program, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--master_port" in result.stdout and "--module" in result.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    # The autotuner's `import mlflow` is tried (and fails at once, as when MLflow is not installed): none of it runs.
    assert "deepspeed.autotuning.autotuner" in imported and "mlflow.version" not in imported
    assert not [name for name in imported if name.startswith("mlflow.")]


def test_the_deepspeed_entry_runs_only_deepspeeds_launcher_programs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", ENTRY_MODULE, "os", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1 and result.stderr.strip().startswith(f"usage: python -m {ENTRY_MODULE} {{")


def test_pdsh_starts_each_hosts_launcher_through_the_entry_and_its_kill_pattern_follows(tmp_path) -> None:
    """DeepSpeed's own pdsh command, as its runner builds it from our command line, rewritten by the entry."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import encode_world_info, parse_args

    command = deepspeed_command(LaunchArguments(run_dir=tmp_path, train_args=["--x", "1"]), tmp_path / "h", list(HOSTS))
    runner = PDSHRunner(parse_args(command[5:]), encode_world_info({host: [0] for host in HOSTS}))
    pdsh, kill, _ = runner.get_cmd({}, {host: [0] for host in HOSTS})
    lean, lean_kill = through_entry(pdsh, kill)
    at = lean.index(sys.executable)
    assert lean[at : at + 5] == [sys.executable, "-u", "-m", ENTRY_MODULE, "deepspeed.launcher.launch"]
    assert lean[:at] + lean[at + 4 :] == pdsh[:at] + pdsh[at + 3 :], "nothing else of DeepSpeed's command changes"
    assert lean[-3:] == ["textsql.training.train", "--x", "1"]
    # pkill -f matches the pattern against each process's command line: the new line, and no longer the old one.
    host_line = " ".join(lean[at:])
    assert re.search(lean_kill[-1], host_line) and not re.search(kill[-1], host_line)
    assert re.search(kill[-1], " ".join(pdsh[at:])), "DeepSpeed's own pattern matched its own line"
    assert lean_kill[:-1] == kill[:-1]


def test_a_pdsh_command_the_entry_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="no longer runs `-m deepspeed.launcher.launch`"):
        through_entry(["pdsh", "python", "-u", "deepspeed.launcher.launch"], ["pdsh", "pkill -f ", "python"])
