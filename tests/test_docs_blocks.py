"""Every block a page tells a reader to run is run, as written, in a copy of the project (tests/helpers/doc_runs.py).

The pages are README.md, the site's pages in the order of its navigation, and CONTRIBUTING.md. Each page's
``bash`` and ``python`` blocks run in page order, sybil keeping one namespace per page: a block runs the page's
earlier blocks first when they have not run yet, and one marked ``<!-- after: COMMAND -->`` the block that is
COMMAND (``make demo``) first. A block marked ``<!-- needs: NAME -->`` is skipped as "needs NAME". A ``bash``
block starts real processes, so it is a ``slow`` test (``make test`` runs it, ``make test-fast`` does not). A
``python`` block is a notebook's parameters cell: it runs, and every name it sets must be a notebook parameter.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from helpers import doc_runs
from helpers.doc_runs import (
    BLOCK_TIMEOUT_S,
    assigned_names,
    left_in_checkout,
    project_files,
    reader_checkout,
    run_block,
)
from helpers.docs import NEEDS, RUN, SHOWN, Block, block_regions, blocks
from helpers.paths import PROJECT_DIR
from sybil import Document, Example, Region, Sybil

ROOT = PROJECT_DIR
# A block shown, not run, must not start as a command would: a reader would copy it into a shell.
LOOKS_RUN = re.compile(r"^(\$ |\.venv/bin/|make |textsql |python3? |pip |export |bash |curl )")


def nav_pages() -> list[Path]:
    """The site's pages in the order of mkdocs.yml's navigation, then any page it does not list."""
    listed = re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    pages = [ROOT / "docs" / name for name in listed if (ROOT / "docs" / name).is_file()]  # not a generated one
    return pages + sorted(set((ROOT / "docs").rglob("*.md")) - set(pages))


PAGES = [ROOT / "README.md", *nav_pages(), ROOT / "CONTRIBUTING.md"]


def evaluate_shell(example: Example) -> None:
    block: Block = example.parsed
    project = example.namespace["_project"]
    before = project_files(project)
    ran = run_block(block, project)
    assert ran.returncode == 0, (
        f"{block} failed ({ran.returncode}):\n{block.text}\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    )
    left = left_in_checkout(project, before)
    assert not left, f"{block} left {left[:10]} in the checkout: write under runs/ or a temporary directory"


def evaluate_parameters(example: Example) -> None:
    from textsql.pipeline.parameters import NOTEBOOKS, declared_parameters

    block: Block = example.parsed
    exec(compile("\n" * block.line + block.text, str(block.page), "exec"), example.namespace)  # noqa: S102
    known = {name for notebook in NOTEBOOKS for name in declared_parameters(notebook)}
    unknown = assigned_names(block.text) - known
    assert not unknown, f"{block} sets {sorted(unknown)}, which no notebook's parameters cell has"


EVALUATORS = {"bash": evaluate_shell, "python": evaluate_parameters}


def runnable_regions(document: Document) -> list[Region]:
    regions = block_regions(document)
    return [
        Region(r.start, r.end, r.parsed, EVALUATORS[r.parsed.language]) for r in regions if r.parsed.language in RUN
    ]


SYBIL = Sybil(parsers=[runnable_regions], patterns=["*.md"])
DOCUMENTS = {page: SYBIL.parse(page) for page in PAGES}
EXAMPLES = {page: list(document.examples()) for page, document in DOCUMENTS.items()}


def first_block(text: str) -> Example:
    """The runnable block, on any page, that is ``text``."""
    found = [example for page in PAGES for example in EXAMPLES[page] if example.parsed.text.strip() == text]
    assert found, f"no block is {text!r}, which a block's <!-- after: --> mark names"
    return found[0]


def examples() -> list[Any]:
    """A test per runnable block; a shell block's bound covers the blocks it builds on as well as its own."""
    shell = [pytest.mark.slow, pytest.mark.timeout(3 * BLOCK_TIMEOUT_S)]
    return [
        pytest.param(example, id=str(example.parsed), marks=shell if example.parsed.language == "bash" else [])
        for page in PAGES
        for example in EXAMPLES[page]
    ]


@pytest.fixture(scope="session")
def reader_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reader_checkout(tmp_path_factory.mktemp("reader"))


def run_once(example: Example, project: Path) -> None:
    """Evaluate ``example`` unless it already ran this session; a failure is remembered for the blocks after it."""
    done = example.namespace.setdefault("_done", {})
    if example.line not in done:
        example.namespace["_project"] = project
        done[example.line] = f"{example.parsed} failed"
        example.evaluate()
        done[example.line] = None
    assert done[example.line] is None, f"an earlier block this one builds on failed: {done[example.line]}"


def prerequisites(example: Example) -> list[Example]:
    """The blocks ``example`` builds on: the one its ``after`` mark names, and the page's earlier runnable blocks
    (a Python block's only the earlier Python blocks: it runs in-process, and fast)."""
    block: Block = example.parsed
    earlier = [
        other
        for other in EXAMPLES[block.page]
        if other.line < example.line and not other.parsed.needs and other.parsed.language in (block.language, "python")
    ]
    return ([first_block(block.after)] if block.after else []) + earlier


@pytest.mark.parametrize("example", examples())
def test_a_pages_block_runs_as_written(example: Example, reader_project: Path) -> None:
    block: Block = example.parsed
    if block.needs:
        pytest.skip(f"needs {block.needs}: {NEEDS.get(block.needs, 'unknown')}")
    for other in prerequisites(example):
        run_once(other, reader_project)
    run_once(example, reader_project)


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
