"""A figure the pages state comes from a committed output they cite, never typed by hand.

A paragraph, list or table that states measured figures carries, just above it, the committed files they come from:
``<!-- figures: bench/setup_cost.json -->``. Every figure in it (a number with a unit: ms, s, minutes, %, GiB,
x, tests...) must be a value of those files, as written or converted (seconds to minutes or milliseconds, a share
to a percentage, a ratio to a percentage change), rounded as the page rounds it. A paragraph that says a figure
was measured, or how long something takes, and cites nothing, fails. A cited file must come from committed code: one
that records ``"uncommitted_changes": true`` (bench/machine.py writes it when the checkout had uncommitted changes) is
refused, and its figures measured again from a clean checkout or taken off the page.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from helpers.paths import PROJECT_DIR

ROOT = PROJECT_DIR
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
CITE = re.compile(r"<!-- figures: (?P<sources>[^>]+?) -->\n\n?(?P<paragraph>.+?)(?:\n\n|\Z)", re.DOTALL)
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.\-/])(?P<low>{NUMBER})(?:-(?P<high>{NUMBER}))?(?:\s|\*\*)*"
    r"(?P<unit>ms|s|seconds?|min|minutes?|CPU-minutes|%|GiB|GB|MiB|x|tests|samples/s|questions/s)(?![\w/])"
)
# What says a figure was measured: such a paragraph must cite where its figures come from.
MEASURED = re.compile(r"\b(measured|took|takes about|about \**\d[\d.]*\** ?(?:minutes|min|s|%))(?!\w)", re.IGNORECASE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# How a committed value may be written on a page: as is, seconds as minutes or milliseconds, a share as a
# percentage, a ratio as a percentage change.
CONVERSIONS = (lambda v: v, lambda v: v / 60, lambda v: v * 1000, lambda v: v * 100, lambda v: abs(v - 1) * 100)


def numbers(value: object) -> Iterator[float]:
    """Every number in a parsed JSON document."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield float(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from numbers(item)


def committed_values(source: str) -> list[float]:
    """The numbers of a committed output: a JSON file's numbers, or the numbers a text file prints."""
    path = ROOT / source
    assert path.is_file(), f"a page cites {source}, which is not in the repository"
    text = path.read_text()
    if path.suffix == ".json":
        return list(numbers(json.loads(text)))
    return [float(found.replace(",", "")) for found in re.findall(NUMBER, text)]


def matches(written: str, values: list[float]) -> bool:
    """Whether the figure as ``written`` is one of ``values``, converted and rounded as written."""
    figure = float(written.replace(",", ""))
    decimals = len(written.split(".")[1]) if "." in written else 0
    return any(round(convert(value), decimals) == figure for value in values for convert in CONVERSIONS)


def shown(page: Path) -> Path:
    return page.relative_to(ROOT) if page.is_relative_to(ROOT) else page


def unsourced_figures(page: Path) -> list[str]:
    """The figures of ``page``'s cited paragraphs that are in none of the files cited."""
    found = []
    for cited in CITE.finditer(FENCE.sub("", page.read_text())):
        values = [value for source in cited["sources"].split() for value in committed_values(source)]
        for figure in FIGURE.finditer(cited["paragraph"]):
            for written in filter(None, (figure["low"], figure["high"])):
                if not matches(written, values):
                    found.append(f"{shown(page)}: {figure.group(0)!r} is in none of {cited['sources']}")
    return found


def uncited_measurements(page: Path) -> list[str]:
    """The paragraphs of ``page`` that state a measured figure and cite no committed output."""
    text = CITE.sub("", FENCE.sub("", page.read_text()))
    return [
        f"{shown(page)}: {paragraph.strip()[:160]!r}"
        for paragraph in text.split("\n\n")
        if MEASURED.search(paragraph) and FIGURE.search(paragraph) and "<!--" not in paragraph
    ]


def uncommitted(value: object) -> bool:
    """Whether a parsed JSON document records, anywhere, that it was measured with uncommitted changes."""
    if isinstance(value, dict):
        return value.get("uncommitted_changes") is True or any(uncommitted(item) for item in value.values())
    if isinstance(value, list):
        return any(uncommitted(item) for item in value)
    return False


def cited_from_uncommitted_code(page: Path) -> list[str]:
    """The files ``page`` cites for its figures that were measured with uncommitted changes in the checkout."""
    found = []
    for cited in CITE.finditer(FENCE.sub("", page.read_text())):
        for source in cited["sources"].split():
            path = ROOT / source
            if path.suffix == ".json" and path.is_file() and uncommitted(json.loads(path.read_text())):
                found.append(f"{shown(page)}: cites {source}, measured with uncommitted changes")
    return found


def test_every_figure_a_page_cites_is_in_the_committed_output_it_cites() -> None:
    found = [figure for page in PAGES for figure in unsourced_figures(page)]
    assert not found, "\n".join(found)
    assert sum(len(CITE.findall(page.read_text())) for page in PAGES) >= 4


def test_a_page_that_states_a_measured_figure_cites_its_source() -> None:
    found = [paragraph for page in PAGES for paragraph in uncited_measurements(page)]
    assert not found, "\n".join(found)


def test_a_page_cites_no_output_of_uncommitted_code() -> None:
    found = [source for page in PAGES for source in cited_from_uncommitted_code(page)]
    assert not found, "measure again from a clean checkout, or take the figure off the page:\n" + "\n".join(found)


def test_the_check_refuses_a_file_measured_with_uncommitted_changes(tmp_path: Path) -> None:
    source = tmp_path / "result.json"
    page = tmp_path / "page.md"
    page.write_text(f"# P\n\n<!-- figures: {source} -->\nSetup took about **6.5 minutes**.\n")
    source.write_text(json.dumps({"machine": {"commit": "6ee50db", "uncommitted_changes": False}, "s": 391.0}))
    assert not cited_from_uncommitted_code(page)
    source.write_text(json.dumps({"machine": {"commit": "6ee50db", "uncommitted_changes": True}, "s": 391.0}))
    assert cited_from_uncommitted_code(page) == [f"{page}: cites {source}, measured with uncommitted changes"]


def test_the_check_refuses_a_typed_figure_and_accepts_one_from_the_file(tmp_path: Path) -> None:
    source = tmp_path / "result.json"
    source.write_text(json.dumps({"install": {"wall_s": 391.0}, "ratio": 0.92}))
    page = tmp_path / "page.md"
    cite = f"<!-- figures: {source} -->"  # an absolute path: the check reads it wherever it is
    page.write_text(f"# P\n\n{cite}\nSetup took about **6.5 minutes**; the loss rose 8 % less.\n")
    assert not unsourced_figures(page) and not uncited_measurements(page)
    page.write_text(f"# P\n\n{cite}\nSetup took about 7.5 minutes.\n")
    assert [found.split(": ", 1)[1] for found in unsourced_figures(page)] == [f"'7.5 minutes' is in none of {source}"]
    page.write_text("# P\n\nThe suite took about 20 minutes.\n")
    assert uncited_measurements(page)


# Figures that were typed into the pages from no committed output: each may come back only from a cited file.
ONCE_TYPED = ("590 tests", "62 ms", "3.6 s", "6.9 s", "5-14 %", "ratio 0.92", "6 min 32 s", "1 min 50 s")


def test_the_figures_once_typed_by_hand_are_gone_or_cited() -> None:
    found = [
        f"{shown(page)}: {figure}"
        for page in [*PAGES, ROOT / "bench" / "gpu_quick.py"]
        for figure in ONCE_TYPED
        if figure in CITE.sub("", page.read_text())
    ]
    assert not found, found
