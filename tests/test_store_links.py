"""The checkpoint store copies files, never links, and never through one: links a worker plants in the shared run
directory (a checkpoint's marker, a file swapped for a link while its upload runs, a linked ``model/``, a
``.download-checkpoint-N``) neither carry the master's files to the store nor let a download write elsewhere.

Each attack runs through the store's real code paths, against fsspec's local filesystem and a real S3 server
(SeaweedFS, slow)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers.checkpoints import complete_checkpoint

from bench.seaweed import BUCKET, S3Server
from textsql.constants import MODEL_SUBDIR
from textsql.errors import StoreError
from textsql.rundir.checkpoints import COMPLETE_MARKER, is_complete_checkpoint
from textsql.store.location import Store, open_store
from textsql.store.sync import complete_steps, download_newest, upload_checkpoint, upload_outputs
from worker.files import UnsafePath

SECRET = b"aws_secret_access_key = the-masters-own\n"


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def store(request, tmp_path: Path, monkeypatch) -> Store:
    """An empty store: fsspec's local filesystem, or a prefix of its own on the S3 server."""
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    s3: S3Server = request.getfixturevalue("s3")
    for key, value in s3.environ().items():
        monkeypatch.setenv(key, value)
    return open_store(f"s3://{BUCKET}/links/{tmp_path.name}")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file of the master's that no worker may read (a stand-in ~/.aws/credentials)."""
    path = tmp_path / "home" / ".aws" / "credentials"
    path.parent.mkdir(parents=True)
    path.write_bytes(SECRET)
    return path


def stored(store: Store) -> dict[str, bytes]:
    """Every object under the store's root, by its path below the root."""
    store.fs.invalidate_cache()
    root = store.path("")
    return {path.removeprefix(root): store.fs.cat_file(path) for path in store.fs.find(root)}


def test_a_marker_linked_to_the_masters_secret_is_refused_and_never_uploaded(
    store: Store, tmp_path: Path, secret: Path
) -> None:
    checkpoint = complete_checkpoint(tmp_path / "run", 20)
    (checkpoint / COMPLETE_MARKER).unlink()
    (checkpoint / COMPLETE_MARKER).symlink_to(secret)
    with pytest.raises(UnsafePath, match=rf"checkpoint-20's {COMPLETE_MARKER} is a symbolic link") as refused:
        upload_checkpoint(store, checkpoint)
    assert "\n" not in str(refused.value)
    assert complete_steps(store) == []
    assert not [path for path, data in stored(store).items() if SECRET in data]


def test_a_linked_checkpoint_directory_is_refused_and_nothing_it_names_uploaded(
    store: Store, tmp_path: Path, secret: Path
) -> None:
    """A worker links ``checkpoint-30`` to a complete-looking directory of the master's (its ~/.aws here)."""
    home_checkpoint = complete_checkpoint(tmp_path / "home-like", 30)
    (home_checkpoint / "credentials").write_bytes(SECRET)
    output = tmp_path / "run"
    output.mkdir()
    (output / "checkpoint-30").symlink_to(home_checkpoint)
    with pytest.raises(UnsafePath, match="checkpoint-30: it is a symbolic link"):
        upload_checkpoint(store, output / "checkpoint-30")
    assert stored(store) == {}


def test_a_file_swapped_for_a_link_while_its_upload_runs_is_not_followed(
    store: Store, tmp_path: Path, secret: Path, caplog
) -> None:
    """The race of a check before the copy: the moment the store is first written, a worker swaps every shard for a
    link to the master's secret."""
    checkpoint = complete_checkpoint(tmp_path / "run", 20)
    shards = [checkpoint / "global_step20" / f"shard_{index}.pt" for index in range(3)]
    for shard in shards:
        shard.write_bytes(b"weights")
    swapped = []

    def swap_all_shards() -> None:
        for shard in [] if swapped else shards:
            shard.unlink()
            shard.symlink_to(secret)
            swapped.append(shard)

    for method in ("put", "open"):
        original = getattr(store.fs, method)

        def swapping(*args, _original=original, **kwargs):
            swap_all_shards()
            return _original(*args, **kwargs)

        object.__setattr__(store.fs, method, swapping)
    with caplog.at_level(logging.WARNING, logger="textsql.store"):
        upload_checkpoint(store, checkpoint)
    assert swapped, "the upload never wrote to the store"
    assert complete_steps(store) == [20]
    assert not [path for path, data in stored(store).items() if SECRET in data]
    assert "symbolic link" in caplog.text


def test_a_linked_model_directory_uploads_nothing_of_what_it_names(store: Store, tmp_path: Path, caplog) -> None:
    ssh = tmp_path / "home" / ".ssh"
    ssh.mkdir(parents=True)
    (ssh / "id_ed25519").write_bytes(SECRET)
    output = tmp_path / "run"
    output.mkdir()
    (output / MODEL_SUBDIR).symlink_to(ssh)
    (output / "run.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="textsql.store"):
        upload_outputs(store, output)
    assert list(stored(store)) == ["run.json"]
    assert f"{MODEL_SUBDIR} is a symbolic link" in caplog.text


def test_a_download_never_writes_through_a_planted_staging_link(store: Store, tmp_path: Path) -> None:
    """Notebook 02 registers the workers before the store's download: a worker has the time to plant
    ``.download-checkpoint-N`` as a link to another run's checkpoint."""
    uploaded = complete_checkpoint(tmp_path / "old", 6)
    (uploaded / "global_step6" / "mp_rank_00_model_states.pt").write_bytes(b"the store's weights")
    upload_checkpoint(store, uploaded)
    victim = complete_checkpoint(tmp_path / "other-run", 6)
    (victim / "global_step6" / "mp_rank_00_model_states.pt").write_bytes(b"the other run's weights")
    before = {path: path.read_bytes() for path in victim.rglob("*") if path.is_file()}
    output = tmp_path / "run"
    output.mkdir()
    (output / ".download-checkpoint-6").symlink_to(victim)
    restored = download_newest(store, output)
    assert {path: path.read_bytes() for path in victim.rglob("*") if path.is_file()} == before
    assert restored == output / "checkpoint-6" and not restored.is_symlink() and is_complete_checkpoint(restored)
    assert (restored / "global_step6" / "mp_rank_00_model_states.pt").read_bytes() == b"the store's weights"


def test_a_checkpoint_marked_complete_without_its_files_fails_the_download_in_one_line(
    store: Store, tmp_path: Path
) -> None:
    store.fs.pipe(store.path("checkpoint-8", COMPLETE_MARKER), b"")
    with pytest.raises(StoreError) as refused:
        download_newest(store, tmp_path / "run")
    assert str(refused.value) == (
        f"checkpoint store {store.where()}: checkpoint-8 is marked complete but its files are not all there; "
        "delete it from the store, or resume from another store prefix"
    )
    assert [path.name for path in (tmp_path / "run").iterdir()] == []
