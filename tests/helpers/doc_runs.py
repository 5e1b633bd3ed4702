"""Running a page's blocks as a reader would: in a copy of the project, with its ``.venv``'s programs.

The copy (:func:`reader_checkout`) holds the project's files as a checkout has them and a ``.venv`` whose ``bin``
is this interpreter's, so ``.venv/bin/textsql`` and ``make demo`` run as on a set-up machine, and whatever a
block writes (``runs/``) lands in the copy. A block that starts a server (``<!-- serves: URL -->``) runs until
the URL answers, then ends; where ``unshare`` can, it runs in a network namespace of its own, so its fixed port
(8000, 5000, 6006...) is never one another test holds.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from helpers.checkout import checkout_copy
from helpers.docs import Block
from helpers.paths import PROJECT_DIR
from textsql.rundir.master_state import STATE_DIR_VAR

# What a server may take to answer here (mkdocs builds the site first; mlflow starts its workers).
SERVER_WAIT_S = 240
# What a block may take here: `make demo` on a 2-core machine shared with other work took 16 minutes.
BLOCK_TIMEOUT_S = 1500
SERVE = """set -m
ip link set lo up 2>/dev/null || true
bash -eo pipefail -c "$BLOCK" &
server=$!
answered=
for _ in $(seq "$WAIT_S"); do
    if curl -s -o /dev/null --max-time 5 "$URL"; then answered=yes; break; fi
    kill -0 "$server" 2>/dev/null || break
    sleep 1
done
kill -TERM -- "-$server" 2>/dev/null; sleep 2; kill -KILL -- "-$server" 2>/dev/null
[ -n "$answered" ] || { echo "nothing answered at $URL" >&2; exit 1; }
echo "answered at $URL"
"""


def reader_checkout(where: Path) -> Path:
    """A copy of the project's files (tracked, or new and not ignored) under ``where``, set up as `make setup-dev`
    leaves a checkout: ``.venv`` is this interpreter's virtual environment, and its setup stamps are newer than the requirements.

    :rtype: pathlib.Path
    """
    project = checkout_copy(where / PROJECT_DIR.name)
    venv = project / ".venv"
    venv.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if not entry.name.startswith(".") and entry.name not in {"lib", "lib64"}:
            (venv / entry.name).symlink_to(entry)
    # Its own site-packages adds this one's by its real path (.pth files included): DeepSpeed compiles its CPU ops
    # from its files' paths, and a path through a link would rebuild the op cache both environments share.
    packages = Path(sysconfig.get_path("purelib"))
    own = venv / packages.relative_to(sys.prefix)
    own.mkdir(parents=True)
    (own / "checkout-environment.pth").write_text(f"import site; site.addsitedir({str(packages)!r})\n")
    if (Path(sys.prefix) / "lib64").is_symlink():
        (venv / "lib64").symlink_to("lib")
    for stamp in (".setup-stamp", ".setup-dev-stamp"):
        (venv / stamp).touch()
    # Jupyter refuses to serve as root without its allow_root setting; a reader is rarely root, a test machine is.
    jupyter = where / "jupyter"
    jupyter.mkdir()
    (jupyter / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"allow_root": True}}))
    return project


def reader_environment(project: Path) -> dict[str, str]:
    """The environment a reader's shell has in ``project``: its ``.venv/bin`` first on the path, the copy's
    packages imported, and no ``TEXTSQL_*`` variable of the test run's own but where runs keep their private state
    (tests/conftest.py's ``master_state_dir``)."""
    environment = {
        name: value for name, value in os.environ.items() if not name.startswith("TEXTSQL_") or name == STATE_DIR_VAR
    }
    environment["PATH"] = f"{project / '.venv' / 'bin'}:{environment['PATH']}"
    environment["PYTHONPATH"] = str(project)
    environment["JUPYTER_CONFIG_DIR"] = str(project.parent / "jupyter")
    return environment


@functools.cache
def own_network() -> list[str]:
    """The command prefix that gives a server a network namespace of its own, or none where unshare cannot."""
    for prefix in (["unshare", "--net"], ["unshare", "--net", "--map-root-user"]):
        tried = shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True, check=False)
        if tried and tried.returncode == 0:
            return prefix
    return []


def run_block(block: Block, project: Path) -> subprocess.CompletedProcess[str]:
    """Run a ``bash`` block in ``project`` (a server until it answers) and return what it printed.

    :rtype: subprocess.CompletedProcess
    """
    environment = reader_environment(project)
    command = ["bash", "-eo", "pipefail", "-c", block.text]
    if block.serves:
        environment |= {"BLOCK": block.text, "URL": block.serves, "WAIT_S": str(SERVER_WAIT_S)}
        command = [*own_network(), "bash", "-c", SERVE]
    return subprocess.run(
        command,
        cwd=project,
        env=environment,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
    )


def project_files(project: Path) -> set[str]:
    """Every file and link under ``project`` (its ``.venv`` left out), relative to it.

    :rtype: set
    """
    found = set()
    for directory, subdirectories, files in os.walk(project):
        if Path(directory) == project:
            subdirectories[:] = [name for name in subdirectories if name != ".venv"]
        found |= {str((Path(directory) / name).relative_to(project)) for name in [*files, *subdirectories]}
    return found


def left_in_checkout(project: Path, before: set[str]) -> list[str]:
    """The files a block created in ``project`` since ``before`` (:func:`project_files`) that git would show as new:
    not under ``runs/`` nor anything else the project's ``.gitignore`` ignores. A block writes under ``runs/`` or a
    temporary directory, never beside the project's own files.

    :rtype: list
    """
    new = sorted(project_files(project) - before)
    if not new:
        return []
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin", "-z"],
        cwd=PROJECT_DIR,
        input="\0".join(new),
        capture_output=True,
        text=True,
        check=False,
    )
    assert ignored.returncode in (0, 1), ignored.stderr
    shown = set(new) - set(filter(None, ignored.stdout.split("\0")))
    # Git shows files, not directories: a new directory of ignored files is not left behind.
    return [path for path in new if path in shown and ((project / path).is_symlink() or (project / path).is_file())]


def assigned_names(source: str) -> set[str]:
    """The names a Python block assigns at its top level.

    :rtype: set
    """
    names = set()
    for statement in ast.parse(source).body:
        targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
        names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names
