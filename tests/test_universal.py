"""Which checkpoints a world of another size loads, and from what: the file layouts DeepSpeed writes.

The conversion itself and the loads run for real in tests/test_shrink.py (slow); here the decisions
are checked on the layouts alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from textsql.errors import LaunchError
from textsql.rundir.universal import (
    UNIVERSAL_LATEST_FILE,
    converted,
    load_universal,
    needs_conversion,
    state_dir,
    written_by,
)


def checkpoint(tmp_path: Path, shards: int, prefix: str = "", universal: bool = False) -> Path:
    """A ``checkpoint-2`` laid out as DeepSpeed writes it: ``latest`` naming ``global_step2`` with one
    optimizer shard per data-parallel rank (none for ZeRO-0), and its universal conversion if asked."""
    path = tmp_path / "checkpoint-2"
    (path / "global_step2").mkdir(parents=True)
    (path / "latest").write_text("global_step2")
    (path / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"")
    for rank in range(shards):
        (path / "global_step2" / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    if universal:
        (path / "global_step2_universal" / "zero").mkdir(parents=True)
        (path / UNIVERSAL_LATEST_FILE).write_text("global_step2_universal")
    return path


@pytest.mark.parametrize("prefix", ["", "bf16_"])
def test_the_writers_are_the_zero_shards_and_zero0_has_none(tmp_path, prefix):
    assert written_by(checkpoint(tmp_path / "a", 3, prefix)) == 3
    assert written_by(checkpoint(tmp_path / "b", 0)) is None


def test_the_same_world_loads_the_checkpoint_as_it_is(tmp_path):
    path = checkpoint(tmp_path, 3)
    assert not load_universal(path, 3) and not needs_conversion(path, 3)


def test_zero0_loads_at_any_size_without_a_conversion(tmp_path):
    path = checkpoint(tmp_path, 0)
    assert not load_universal(path, 2) and not needs_conversion(path, 5)


def test_another_world_loads_the_conversion(tmp_path):
    path = checkpoint(tmp_path, 3, universal=True)
    assert converted(path) == path / "global_step2_universal"
    assert load_universal(path, 2) and not needs_conversion(path, 2)


def test_another_world_without_a_conversion_is_refused_with_the_fix(tmp_path):
    path = checkpoint(tmp_path, 3)
    assert needs_conversion(path, 2)
    with pytest.raises(
        LaunchError,
        match=r"checkpoint-2 was written by 3 data-parallel ranks and this run has 2; resume with 3 ranks, "
        r"or convert it first: python -m textsql.rundir.universal ",
    ):
        load_universal(path, 2)


@pytest.mark.parametrize("tag", ["", "global_step9_universal", "../elsewhere", "global_step2"])
def test_a_conversion_counts_only_when_latest_universal_names_its_directory(tmp_path, tag):
    """Naming nothing, a missing directory, one outside the checkpoint or the original's state (no ``zero/``): no conversion."""
    path = checkpoint(tmp_path, 3)
    (path / UNIVERSAL_LATEST_FILE).write_text(tag)
    assert converted(path) is None and needs_conversion(path, 2)


@pytest.mark.parametrize("tag", ["../elsewhere", "/tmp", ".", "linked"])
def test_latest_is_checked_where_it_is_used_not_only_when_the_checkpoint_was_found_complete(tmp_path, tag):
    """A worker rewrites ``latest`` after the completeness check: the conversion still reads nothing outside the
    checkpoint (a tag with a path, the checkpoint itself, a link to a directory elsewhere)."""
    path = checkpoint(tmp_path, 3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for rank in range(5):
        (elsewhere / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (path / "linked").symlink_to(elsewhere)
    (path / "latest").write_text(tag)
    assert state_dir(path) is None and written_by(path) is None
