"""What `make test-fast` (``pytest -m "not slow"``) relies on: a test that starts real processes is marked ``slow``."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

# Fixtures that start real processes: worker agents with their own sshd, an sshd alone, a Slurm cluster, the session's
# S3 server (tests/conftest.py), an MLflow tracking server (tests/test_tracking_server.py) or the session's `make demo`.
PROCESS_FIXTURES = frozenset(
    {"two_local_workers", "loopback_sshd", "slurm_cluster", "s3", "mlflow_server", "docs_demo"}
)


def unmarked_process_tests(items: Iterable[pytest.Item]) -> list[str]:
    """Node ids of the tests that use a fixture of :data:`PROCESS_FIXTURES` and are not marked ``slow``."""
    return [
        item.nodeid
        for item in items
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("slow")
    ]
