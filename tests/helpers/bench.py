"""How the bench tests run the bench: ``python -m bench --smoke`` in a subprocess, writing into a test's directory, from
this project or from a copy of it as a clone has it (tests/helpers/checkout.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from textsql.constants import PROJECT_DIR


def run_bench(
    tmp_path: Path, *args: str, timeout: float, capture_output: bool = True, project: Path = PROJECT_DIR
) -> dict:
    """Run ``python -m bench --smoke ARGS`` in ``project`` (importing its own bench and textsql) with
    ``--out tmp_path`` and ``--work tmp_path/work``; the results.json it wrote.

    :param capture_output: ``False`` lets a long run's progress reach the terminal (``pytest -s``).
    :param project: this project, or a copy of it (:func:`helpers.checkout.checkout_copy`).
    :raises subprocess.CalledProcessError: the bench failed; ``subprocess.TimeoutExpired``: it ran past ``timeout``.
    """
    command = [
        sys.executable,
        "-m",
        "bench",
        "--smoke",
        *args,
        "--out",
        str(tmp_path),
        "--work",
        str(tmp_path / "work"),
    ]
    subprocess.run(
        command,
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project)},
        check=True,
        timeout=timeout,
        capture_output=capture_output,
    )
    return json.loads((tmp_path / "results.json").read_text())


def add_site(python: Path, site: Path | str, name: str) -> None:
    """Make the virtual environment of ``python`` see the packages in ``site``: a ``NAME.pth`` naming it in the
    environment's own purelib, which only that environment reads."""
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / f"{name}.pth").write_text(f"{site}\n")
