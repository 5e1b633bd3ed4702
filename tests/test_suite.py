"""The suite's own rules: `make test-fast` leaves out what starts processes; test modules share tests/helpers/,
not each other."""

from __future__ import annotations

import ast

from helpers.markers import unmarked_process_tests
from helpers.paths import PROJECT_DIR


def test_a_test_using_a_process_fixture_must_be_marked_slow(pytester):
    pytester.makeini("[pytest]\nmarkers = slow")
    items = pytester.getitems(
        """
        import pytest

        @pytest.fixture
        def loopback_sshd():
            yield

        def test_forgot_the_marker(loopback_sshd):
            pass

        @pytest.mark.slow
        def test_marked(loopback_sshd):
            pass

        def test_starts_nothing():
            pass
        """
    )
    assert [nodeid.rpartition("::")[2] for nodeid in unmarked_process_tests(items)] == ["test_forgot_the_marker"]


def test_no_test_module_imports_another_or_the_conftest():
    tests = PROJECT_DIR / "tests"
    modules = {path.stem for path in tests.glob("*.py")}
    imported = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            imported += [f"{path.relative_to(tests)}: {name}" for name in names if name.split(".")[0] in modules]
    assert imported == [], "move what they share to tests/helpers/"
