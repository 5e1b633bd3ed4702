"""How the bench tests run the bench: ``python -m bench --smoke`` in a subprocess, writing into a test's directory, from
this project or from a copy of it as a clone has it (:func:`checkout_copy`), on the shipped sample prepared once
(:func:`prepare_sample`) and copied into each run's scratch directory (:func:`seeded`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from textsql.constants import PROJECT_DIR

# Prepares the shipped sample as the bench's figures do (bench.fullscale.prepare_data), in both forms they read.
PREPARE_SAMPLE = """
import sys
from pathlib import Path

from bench.fullscale import prepare_data

for form in ("question", "schema"):
    print(prepare_data(Path(sys.argv[1]), form))
"""


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


def prepare_sample(project: Path, target: Path) -> list[Path]:
    """The shipped sample prepared by ``project``'s own bench in a fresh Python, in the question and the schema form,
    into ``target``: what ``python -m bench`` would prepare in its scratch directory.

    :returns: the two prepared directories.
    :rtype: list[pathlib.Path]
    """
    ran = subprocess.run(
        [sys.executable, "-c", PREPARE_SAMPLE, str(target)],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project)},
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if ran.returncode != 0:
        raise RuntimeError(f"preparing the sample in {project} failed: {ran.stderr[-4000:]}")
    return [Path(line) for line in ran.stdout.splitlines()[-2:]]


def seeded(work: Path, prepared: Path) -> Path:
    """``work`` holding a copy of each directory in ``prepared`` (:func:`prepare_sample`): the bench's
    ``prepare_data`` finds the sample prepared there and prepares nothing. A copy, since the bench's datasets
    write their cache files beside the data.

    :rtype: pathlib.Path
    """
    work.mkdir(parents=True, exist_ok=True)
    for directory in prepared.iterdir():
        shutil.copytree(directory, work / directory.name)
    return work
