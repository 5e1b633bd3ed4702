"""CML session task, the AMP's first: install the runtime requirements (requirements.txt, the project itself
included with ``-e .``); tests and lint (requirements-dev.txt) are not installed.

The runtime's own Jupyter stays as it is: a package below that the runtime already has is pinned at its
installed version instead of ours. Cloudera's runtimes serve their editor and kernels from these, and
upgrading ipykernel or its dependencies in a project can stop the project's sessions and jobs from
starting (Cloudera ML docs, "Restrictions for upgrading R and Python packages"). Where one is missing
(a bare Python) the pinned one from requirements.txt is installed.

This script reads requirements.txt itself: nothing of the project is installed yet when it runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
REQUIREMENTS = PROJECT_DIR / "requirements.txt"
# The runtime's editor and kernel, and the kernel's dependencies Cloudera names.
RUNTIME_OWNED = ("jupyterlab", "jupyter-server", "ipykernel", "ipython", "traitlets", "jupyter-client", "tornado")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503: case and ``-_.`` runs do not matter).

    :rtype: str
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str) -> str | None:
    """The version of ``name`` in this Python, or None.

    :rtype: str | None
    """
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def install_arguments(
    requirements: str, installed: Callable[[str], str | None] = installed_version, project_dir: Path = PROJECT_DIR
) -> list[str]:
    """pip's arguments for the runtime: our pins, with the runtime's own Jupyter pinned where it has one.

    :param requirements: the text of requirements.txt.
    :param installed: the installed version of a distribution, or None.
    :param project_dir: what ``-e .`` names.
    :rtype: list[str]
    """
    kept = {canonical(name): version for name in RUNTIME_OWNED if (version := installed(name)) is not None}
    arguments = []
    for line in requirements.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-e"):
            # Absolute, so the install does not depend on the session's working directory.
            arguments += ["-e", str(project_dir)]
        elif canonical(re.split(r"[\s=<>!~;\[]", line, maxsplit=1)[0]) not in kept:
            arguments.append(line)
    return arguments + [f"{name}=={version}" for name, version in sorted(kept.items())]


def main() -> None:
    """Install the runtime requirements into this Python."""
    arguments = install_arguments(REQUIREMENTS.read_text())
    print(f"installing the runtime requirements: {' '.join(arguments)}", flush=True)
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--progress-bar", "off", *arguments], check=False)
    if result.returncode != 0:
        sys.exit(
            f"Error: pip could not install the runtime requirements (exit code {result.returncode}); its reason is above"
        )


if __name__ == "__main__":
    main()
