"""The types kept by a tool: mypy over textsql/ and worker/ with pyproject.toml's [tool.mypy] (strict on worker/)."""

import shutil
import subprocess
import sys
from pathlib import Path

from helpers.paths import PROJECT_DIR


def mypy(*arguments: str, cwd: Path = PROJECT_DIR) -> subprocess.CompletedProcess:
    executable = shutil.which("mypy", path=str(Path(sys.executable).parent))
    assert executable, f"mypy is not installed next to {sys.executable}: run `make setup-dev`"
    # Its cache (.mypy_cache in the checkout) keeps a rerun to seconds; the first run reads torch's stubs.
    return subprocess.run([executable, *arguments], check=False, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_mypy_passes():
    result = mypy()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr


def test_worker_is_checked_strictly(tmp_path):
    """The strict flags reach worker/: a function without annotations there is an error, as it is in textsql."""
    shutil.copytree(PROJECT_DIR / "worker", tmp_path / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_DIR / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "worker" / "untyped.py").write_text(
        "def port(value):\n    return int(value)\n\n\ndef any_dict() -> dict:\n    return {}\n"
    )
    result = mypy("--cache-dir", str(tmp_path / "cache"), "worker", cwd=tmp_path)
    assert result.returncode == 1
    assert "worker/untyped.py:1: error: Function is missing a type annotation" in result.stdout
    assert 'worker/untyped.py:5: error: Missing type arguments for generic type "dict"' in result.stdout
