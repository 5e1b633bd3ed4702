"""Shared fixtures. Paths to the project, its assets and the shared real data."""
from pathlib import Path

import pytest

PROJECT_DIR = Path(__file__).resolve().parent.parent
SHARED_DATA_DIR = PROJECT_DIR.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """../shared/data beside the checkout (real WikiSQL files); tests needing it skip without it."""
    if not SHARED_DATA_DIR.is_dir():
        pytest.skip(f"{SHARED_DATA_DIR} is not present")
    return SHARED_DATA_DIR


@pytest.fixture
def wikisql_release_copy(tmp_path: Path) -> Path:
    """A writable copy of the shipped WikiSQL sample (release layout), for tests that corrupt it."""
    import shutil

    from textsql.constants import SAMPLE_DATA_DIR

    return Path(shutil.copytree(SAMPLE_DATA_DIR, tmp_path / "release"))
