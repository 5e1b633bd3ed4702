"""Every block a page tells a reader to run is run, as written, in a copy of the project (tests/helpers/doc_runs.py).

Which pages, in which order, and what a block builds on: tests/helpers/doc_blocks.py. A block marked
``<!-- needs: NAME -->`` is skipped as "needs NAME". A ``bash`` block starts real processes, so it is a ``slow`` test
(``make test`` runs it, ``make test-fast`` does not). The copy is the session's ``reader_project`` (tests/conftest.py),
which tests reading a block's run (``docs_demo``) share.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from helpers import doc_runs
from helpers.doc_blocks import EXAMPLES, PAGES, run_with_prerequisites
from helpers.doc_runs import BLOCK_TIMEOUT_S, left_in_checkout, project_files, run_block
from helpers.docs import NEEDS, RUN, SHOWN, Block, blocks
from helpers.paths import PROJECT_DIR
from sybil import Example

ROOT = PROJECT_DIR
# A block shown, not run, must not start as a command would: a reader would copy it into a shell.
LOOKS_RUN = re.compile(r"^(\$ |\.venv/bin/|make |textsql |python3? |pip |export |bash |curl )")


def examples() -> list[Any]:
    """A test per runnable block; a shell block's bound covers the blocks it builds on as well as its own."""
    shell = [pytest.mark.slow, pytest.mark.timeout(3 * BLOCK_TIMEOUT_S)]
    return [
        pytest.param(example, id=str(example.parsed), marks=shell if example.parsed.language == "bash" else [])
        for page in PAGES
        for example in EXAMPLES[page]
    ]


@pytest.mark.parametrize("example", examples())
def test_a_pages_block_runs_as_written(example: Example, reader_project: Path) -> None:
    block: Block = example.parsed
    if block.needs:
        pytest.skip(f"needs {block.needs}: {NEEDS.get(block.needs, 'unknown')}")
    run_with_prerequisites(example, reader_project)


def undecided(pages: list[Path]) -> list[str]:
    """The blocks of ``pages`` whose fence names no language of the convention, or that are shown but look run."""
    found = []
    for block in blocks(pages):
        if block.language not in RUN | SHOWN:
            found.append(f"{block}: {block.language or 'no language'}")
        elif block.language in SHOWN and LOOKS_RUN.match(block.text.lstrip()):
            found.append(f"{block}: a {block.language} block that starts as a command")
    return found


def test_every_block_is_either_run_or_shown() -> None:
    """CONTRIBUTING.md's convention: ``bash`` and ``python`` blocks are run; ``text`` and ``console`` show output,
    ``json``, ``yaml``, ``sql``, ``toml`` and ``ini`` a file's contents, ``mermaid`` a drawing."""
    assert not undecided([*PAGES, ROOT / "CHANGELOG.md"]), undecided([*PAGES, ROOT / "CHANGELOG.md"])
    assert sum(len(found) for found in EXAMPLES.values()) >= 30


def test_the_convention_check_sees_a_fence_without_a_language_and_a_command_shown_as_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```\nmake demo\n```\n\n```text\n.venv/bin/textsql demo\n```\n\n```text\nok\n```\n")
    assert [line.split(": ", 1)[1] for line in undecided([page])] == [
        "no language",
        "a text block that starts as a command",
    ]


def test_a_block_that_writes_beside_the_projects_files_is_caught(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / ".venv").mkdir(parents=True)
    (project / "README.md").write_text("# P\n")
    before = project_files(project)
    ran = run_block(
        Block(tmp_path / "page.md", 1, "bash", "mkdir -p my-data runs/data\ntouch my-data/a runs/data/b\n"), project
    )
    assert ran.returncode == 0, ran.stderr
    assert left_in_checkout(project, before) == ["my-data/a"]  # runs/ (ignored by git) is where blocks write
    (project / "my-data" / "a").unlink()
    assert left_in_checkout(project, before) == []


def test_a_block_stops_at_its_first_failing_command(tmp_path: Path) -> None:
    ran = run_block(Block(tmp_path / "page.md", 1, "bash", "false\ntouch reached\n"), tmp_path)
    assert ran.returncode != 0 and not (tmp_path / "reached").exists()


def test_a_server_block_passes_once_it_answers_and_is_ended(tmp_path: Path) -> None:
    server = "python3 -m http.server 8000 --bind 127.0.0.1 > served.log 2>&1\n"
    ran = run_block(Block(tmp_path / "page.md", 1, "bash", server, serves="http://127.0.0.1:8000"), tmp_path)
    assert ran.returncode == 0 and "answered at http://127.0.0.1:8000" in ran.stdout, ran.stderr
    assert '"GET / HTTP' in (tmp_path / "served.log").read_text()


def test_a_server_block_that_never_answers_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doc_runs, "SERVER_WAIT_S", 3)
    ran = run_block(Block(tmp_path / "page.md", 1, "bash", "sleep 60\n", serves="http://127.0.0.1:9"), tmp_path)
    assert ran.returncode == 1 and "nothing answered at http://127.0.0.1:9" in ran.stderr
