"""The pages' runnable blocks, each run at most once a session in the reader's copy (tests/helpers/doc_runs.py).

The pages are README.md, the site's pages in the order of its navigation, and CONTRIBUTING.md. Each page's
``bash`` and ``python`` blocks run in page order, sybil keeping one namespace per page: a block runs the page's
earlier blocks first when they have not run yet, and one marked ``<!-- after: COMMAND -->`` the block that is
COMMAND (``make demo``) first. A ``python`` block is a notebook's parameters cell: it runs, and every name it sets
must be a notebook parameter. tests/test_docs_blocks.py makes a test of each block; a test that asserts facts of
a block's run (the demo of ``make demo``, the store guide's two launches) reads it with :func:`ran` instead of
running the same commands again.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from sybil import Document, Example, Region, Sybil

from helpers.doc_runs import assigned_names, left_in_checkout, project_files, run_block
from helpers.docs import RUN, Block, block_regions
from helpers.paths import PROJECT_DIR


def nav_pages() -> list[Path]:
    """The site's pages in the order of mkdocs.yml's navigation, then any page it does not list."""
    listed = re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)$", (PROJECT_DIR / "mkdocs.yml").read_text(), re.MULTILINE)
    pages = [PROJECT_DIR / "docs" / name for name in listed if (PROJECT_DIR / "docs" / name).is_file()]
    return pages + sorted(set((PROJECT_DIR / "docs").rglob("*.md")) - set(pages))  # and no generated one


PAGES = [PROJECT_DIR / "README.md", *nav_pages(), PROJECT_DIR / "CONTRIBUTING.md"]


def evaluate_shell(example: Example) -> None:
    block: Block = example.parsed
    project = example.namespace["_project"]
    before = project_files(project)
    ran = run_block(block, project)
    example.namespace.setdefault("_ran", {})[example.line] = ran
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
EXAMPLES = {page: list(SYBIL.parse(page).examples()) for page in PAGES}


def first_block(text: str) -> Example:
    """The runnable block, on any page, that is ``text``."""
    found = [example for page in PAGES for example in EXAMPLES[page] if example.parsed.text.strip() == text]
    assert found, f"no block is {text!r}, which a block's <!-- after: --> mark or a test names"
    return found[0]


def page_blocks(page: Path) -> list[Example]:
    """The runnable blocks of ``page`` that need nothing a test machine lacks, in page order."""
    return [example for example in EXAMPLES[page] if not example.parsed.needs]


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


def run_with_prerequisites(example: Example, project: Path) -> None:
    """Run ``example`` once in ``project``, after the blocks it builds on."""
    for other in prerequisites(example):
        run_once(other, project)
    run_once(example, project)


def ran(example: Example, project: Path) -> subprocess.CompletedProcess[str]:
    """What the shell block ``example`` printed when it ran in ``project`` (run now if it has not run yet)."""
    run_with_prerequisites(example, project)
    return example.namespace["_ran"][example.line]
