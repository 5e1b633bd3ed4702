"""How `make test` spreads the tests over its pytest-xdist workers (``--dist loadgroup``).

A worker takes one group at a time, in the order the groups come in the collection. Each test module is a group, so
a module fixture (the demo scenario, an mlflow server) is set up once, on one worker. The tests that read the
session's docs runs (:data:`DOCS_FIXTURES`) are one group: the reader's copy and its `make demo` are built once. So
are the docs blocks' own tests, which serve on the pages' fixed ports. The docs group goes first, then every group
that starts real processes, then the rest: the longest work starts first and the short tests fill the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from helpers.markers import PROCESS_FIXTURES

# Session fixtures built once a session, by the worker that runs every test using them.
DOCS_FIXTURES = frozenset({"reader_project", "docs_demo"})
DOCS_GROUP = "docs"
# Modules whose tests bind the ports the pages' servers use (8000, 5000, 6006, 8888): they run beside no docs block.
DOCS_PORT_MODULES = frozenset({"test_docs_blocks.py"})


def group_of(item: pytest.Item) -> str:
    """The xdist group of a test: :data:`DOCS_GROUP` for the docs runs' readers, else its module's path.

    :rtype: str
    """
    if DOCS_FIXTURES & set(getattr(item, "fixturenames", ())) or item.path.name in DOCS_PORT_MODULES:
        return DOCS_GROUP
    return item.nodeid.split("::", 1)[0]


def schedule(items: list[pytest.Item]) -> None:
    """Mark each test with its group and order the collection as the workers should take the groups: the docs group,
    the groups that start processes (:data:`helpers.markers.PROCESS_FIXTURES` or the ``slow`` marker), the rest.
    The order within a group is kept."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(group_of(item), []).append(item)
    ordered = sorted(groups.items(), key=lambda entry: _rank(entry[0], entry[1]))
    items[:] = [item for _, members in ordered for item in members]
    for name, members in ordered:
        for item in members:
            item.add_marker(pytest.mark.xdist_group(name))


def _rank(name: str, members: Sequence[pytest.Item]) -> int:
    if name == DOCS_GROUP:
        return 0
    starts_processes = any(
        item.get_closest_marker("slow") or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        for item in members
    )
    return 1 if starts_processes else 2
