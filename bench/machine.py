"""The machine and the releases a bench run measured, and the command line and JSON of a command that measures one
figure (``python -m bench compile-warmup``, ``norms``)."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import psutil

from textsql.constants import PROJECT_DIR
from textsql.json_files import write_json

logger = logging.getLogger(__name__)

# "COMMIT:TREE" (git rev-parse --short HEAD, git rev-parse HEAD^{tree}) of a clean checkout copied to a machine
# whose copy's .git may not match it; bench/device.sh passes it on.
COMMIT_VARIABLE = "BENCH_COMMIT"

RELEASES = ("torch", "deepspeed", "transformers", "datasets", "accelerate", "tokenizers", "tensorboard", "textsql")


def describe_machine() -> dict:
    """CPU, cores, memory, OS, Python and the current load.

    :rtype: dict
    """
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "gpu": _gpu(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def releases(written: Path | None = None) -> dict:
    """Installed versions of the packages the figures depend on, and the project's commit.

    :param written: the figure's own file, rewritten after each arm: in a checkout, its earlier version is not a
        change to the code that measured it.
    :rtype: dict
    """
    found = {}
    for name in RELEASES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    claimed = os.environ.get(COMMIT_VARIABLE)
    if claimed:
        # A copied tree whose .git may be stale (a GPU machine's copy): the files must hash to the claimed tree.
        commit, _, tree = claimed.partition(":")
        found["commit"] = commit
        found["uncommitted_changes"] = not tree or _files_tree() != tree
        return found
    found["commit"] = _git("rev-parse", "--short", "HEAD")
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *_leaving_out(written))
    found["uncommitted_changes"] = bool(changed)
    return found


def _leaving_out(path: Path | None) -> list[str]:
    """A git pathspec leaving ``path`` out, where it lies in the checkout."""
    project = PROJECT_DIR.resolve()
    if path is None or not path.resolve().is_relative_to(project):
        return []
    return [f":(exclude){path.resolve().relative_to(project)}"]


def _files_tree() -> str | None:
    """The git tree hash of the files as they are (what ``git add -A`` would commit), through a throwaway index so
    the checkout's own index is left alone."""
    with tempfile.TemporaryDirectory() as scratch:
        index = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        if _git("add", "-A", env=index) is None:
            return None
        return _git("write-tree", env=index)


def figure_arguments(
    argv: list[str] | None,
    prog: str,
    doc: str,
    result: Path,
    more: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """``--smoke``, ``--device`` and ``--out`` (default ``result``), and what ``more`` adds, parsed from ``argv``;
    ``doc``'s first paragraph is the description.

    :rtype: argparse.Namespace
    """
    parser = argparse.ArgumentParser(prog=f"python -m bench {prog}", description=doc.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the embedded small T5 and a few steps (the tests)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where it runs")
    parser.add_argument("--out", type=Path, default=result, help="the JSON written (default: %(default)s)")
    if more is not None:
        more(parser)
    return parser.parse_args(argv)


def write_figure(path: Path, figure: dict) -> None:
    """``figure`` with the machine and releases it was measured on, as JSON at ``path``; says so on stdout."""
    write_json(path, {**figure, "machine": describe_machine(), "releases": releases(written=path)})
    print(f"wrote {path}", flush=True)


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _git(*args: str, env: dict[str, str] | None = None) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=PROJECT_DIR, env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
