"""The project as a clone has it: its tracked files and the new ones git does not ignore, copied elsewhere."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from helpers.paths import PROJECT_DIR


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


def checkout_copy(root: Path) -> Path:
    """Copy :func:`listed_files` into ``root``: a link (textsql/assets/dsconfig) stays a link, and a tracked file
    deleted in the working tree is not copied.

    :rtype: pathlib.Path
    """
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
