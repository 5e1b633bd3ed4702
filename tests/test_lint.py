"""The code's tidiness kept by tools: ruff's lint and format over the whole tree (pyproject.toml's [tool.ruff])."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import PROJECT_DIR


def run_tool(*command: str) -> subprocess.CompletedProcess:
    executable = shutil.which(command[0], path=str(Path(sys.executable).parent))
    assert executable, f"{command[0]} is not installed next to {sys.executable}: run `make setup-dev`"
    return subprocess.run(
        [executable, *command[1:]], check=False, cwd=PROJECT_DIR, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("command", [("ruff", "check", "."), ("ruff", "format", "--check", ".")])
def test_ruff_passes(command):
    result = run_tool(*command)
    assert result.returncode == 0, result.stdout + result.stderr
