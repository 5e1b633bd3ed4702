"""How `make test` spreads the tests over its two pytest-xdist workers (``--dist loadscope``, with these groups).

A worker takes one group at a time, in the order the groups come in the collection. Each test module is a group, so
a module fixture (the demo scenario, an mlflow server) is set up once, on one worker. The modules whose tests read the
session's docs runs (:data:`DOCS_FIXTURES`) are one group, :data:`DOCS_MODULES`: the reader's copy and its `make demo`
are built once, and the pages' servers (on their fixed ports: 8000, 5000, 6006, 8888) never run beside the docs
blocks' own tests. The docs group goes first, then every group that starts real processes, then the rest: the
longest work starts first and the short tests fill the end.

The groups are named from node ids alone, where xdist's scheduler places them; a test that reads the docs runs from
another module is refused at collection (:func:`misplaced_docs_readers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from xdist.scheduler import LoadScopeScheduling

from helpers.markers import PROCESS_FIXTURES

# Session fixtures built once a session, by the worker that runs the group of every test using them.
DOCS_FIXTURES = frozenset({"reader_project", "docs_demo"})
DOCS_MODULES = frozenset(
    {"tests/test_docs.py", "tests/test_docs_blocks.py", "tests/test_notebooks.py", "tests/test_store_runs.py"}
)
DOCS_GROUP = "docs"


def group_of(nodeid: str) -> str:
    """The group of a test: :data:`DOCS_GROUP` for a test of :data:`DOCS_MODULES`, else its module's path.

    :rtype: str
    """
    module = nodeid.split("::", 1)[0]
    return DOCS_GROUP if module in DOCS_MODULES else module


class GroupScheduling(LoadScopeScheduling):
    """xdist's ``loadscope`` with :func:`group_of` for the scopes."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)


def misplaced_docs_readers(items: Iterable[pytest.Item]) -> list[str]:
    """Node ids of the tests that use a fixture of :data:`DOCS_FIXTURES` outside :data:`DOCS_MODULES`: on another
    worker they would build the reader's copy and run the demo a second time."""
    return [
        item.nodeid
        for item in items
        if DOCS_FIXTURES & set(getattr(item, "fixturenames", ())) and group_of(item.nodeid) != DOCS_GROUP
    ]


def order_groups(items: list[pytest.Item]) -> None:
    """Order the collection as the workers should take the groups: the docs group, the groups that start processes
    (:data:`helpers.markers.PROCESS_FIXTURES` or the ``slow`` marker), the rest; the order within a group is kept."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)
    ordered = sorted(groups.items(), key=lambda entry: _rank(entry[0], entry[1]))
    items[:] = [item for _, members in ordered for item in members]


def _rank(name: str, members: Sequence[pytest.Item]) -> int:
    if name == DOCS_GROUP:
        return 0
    starts_processes = any(
        item.get_closest_marker("slow") or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) for item in members
    )
    return 1 if starts_processes else 2
