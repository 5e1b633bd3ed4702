"""How the bench tests run the bench: ``python -m bench --smoke`` in a subprocess, writing into a test's directory, from
this project or from a copy of it as a clone has it (:func:`checkout_copy`)."""

from __future__ import annotations

import json
import os
import shutil
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
    :param project: this project, or a copy of it (:func:`checkout_copy`).
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


def listed_files() -> list[str]:
    """What a clone of the project holds: its tracked files and the new ones git does not ignore, relative to it.

    :rtype: list[str]
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=PROJECT_DIR,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return list(filter(None, listed.split("\0")))


def checkout_copy(where: Path) -> Path:
    """Copy :func:`listed_files` into ``where/textsql``: a link (textsql/assets/dsconfig) stays a link, and a tracked
    file deleted in the working tree is not copied.

    :rtype: pathlib.Path
    """
    root = where / "textsql"
    for name in listed_files():
        source = PROJECT_DIR / name
        if source.is_symlink() or source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name, follow_symlinks=False)
    return root


def missing_from(copy: Path) -> list[str]:
    """The files of :func:`listed_files` the working tree holds and ``copy`` does not.

    :rtype: list[str]
    """
    return [
        name
        for name in listed_files()
        if ((PROJECT_DIR / name).is_symlink() or (PROJECT_DIR / name).is_file())
        and not ((copy / name).is_symlink() or (copy / name).exists())
    ]
