"""The checkpoint store (textsql.store): refusals in one line before anything starts, checkpoints marked complete by
one object written last, retention, and download; against a real S3 server (SeaweedFS) where S3 matters, and
through fsspec's local filesystem where it does not. The runs of two workers are in tests/test_store_runs.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.checkpoints import complete_checkpoint
from helpers.launch import textsql_train
from helpers.paths import PROJECT_DIR

from bench.seaweed import BUCKET, S3Server
from textsql.errors import StoreError
from textsql.launching.launch import _prepare_local
from textsql.rundir.checkpoints import COMPLETE_MARKER, is_complete_checkpoint
from textsql.store.location import check_store, open_store
from textsql.store.sync import apply_retention, complete_steps, download_newest, upload_checkpoint


def fake_checkpoint(output: Path, step: int, shards: int = 1, shard_bytes: int = 1000) -> Path:
    """A complete checkpoint-N whose state holds ``shards`` random files."""
    checkpoint = complete_checkpoint(output, step)
    for index in range(shards):
        (checkpoint / f"global_step{step}" / f"shard_{index:03}.pt").write_bytes(os.urandom(shard_bytes))
    return checkpoint


def test_an_unknown_scheme_is_refused_in_one_line() -> None:
    with pytest.raises(StoreError, match=r"unknown scheme 'nosuch'; use s3://BUCKET/PREFIX") as refused:
        open_store("nosuch://bucket/runs")
    assert "\n" not in str(refused.value)


def test_a_scheme_whose_package_is_missing_names_it() -> None:
    pytest.importorskip("s3fs")
    with pytest.raises(StoreError, match=r"gs:// needs the package gcsfs, not installed here; pip install gcsfs"):
        open_store("gs://bucket/runs")


def test_a_local_store_keeps_save_total_limit_and_downloads_the_newest_marked(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path / 'store'}")
    check_store(store)
    for step in (2, 4, 6):
        upload_checkpoint(store, fake_checkpoint(tmp_path / "run", step))
    assert complete_steps(store) == [2, 4, 6]
    assert apply_retention(store, 2) == [2]
    assert complete_steps(store) == [4, 6]
    # A checkpoint whose marker never came (an upload cut off) is not chosen, however new.
    (tmp_path / "store" / "checkpoint-8" / "global_step8").mkdir(parents=True)
    restored = download_newest(store, tmp_path / "fresh")
    assert restored == tmp_path / "fresh" / "checkpoint-6" and is_complete_checkpoint(restored)
    assert download_newest(store, tmp_path / "fresh") is None, "a run dir as new as the store downloads nothing"


def test_the_local_launchers_ranks_get_no_store_credentials(tmp_path: Path, monkeypatch) -> None:
    from textsql.launching.command import LaunchArguments

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-pass")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKX")
    _, env, _ = _prepare_local(LaunchArguments(run_dir=tmp_path, launcher="local", ranks=1), tmp_path, "id")
    assert not [key for key in env if key.startswith("AWS_")]


def test_the_store_extra_is_pinned_beside_the_installed_fsspec() -> None:
    import fsspec

    pins = dict(
        line.split("==") for line in (PROJECT_DIR / "requirements-store.txt").read_text().splitlines() if "==" in line
    )
    assert pins["s3fs"] == fsspec.__version__


@pytest.mark.slow
@pytest.mark.parametrize(
    ("keys", "reason"),
    [
        ("wrong-secret", "the secret key does not match the access key (SignatureDoesNotMatch)"),
        ("reader", "these keys may not write there (AccessDenied)"),
        ("unknown-key", "the store knows no such access key (InvalidAccessKeyId)"),
    ],
)
def test_keys_that_cannot_write_are_refused_in_one_line(s3: S3Server, monkeypatch, keys: str, reason: str) -> None:
    chosen = {
        "wrong-secret": s3.environ(secret="not-the-secret"),
        "reader": s3.environ(access_key=s3.reader_key, secret=s3.reader_secret),
        "unknown-key": s3.environ(access_key="AKNOBODY"),
    }[keys]
    for key, value in chosen.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StoreError) as refused:
        check_store(open_store(f"s3://{BUCKET}/store-test/refused"))
    assert (
        str(refused.value)
        == f"checkpoint store s3://{BUCKET}/store-test/refused: {reason}"
        + {
            "wrong-secret": ": check AWS_SECRET_ACCESS_KEY",
            "reader": ": use keys with write permission on the bucket",
            "unknown-key": ": check AWS_ACCESS_KEY_ID",
        }[keys]
    )
    assert s3.secret_key not in str(refused.value) and "not-the-secret" not in str(refused.value)


@pytest.mark.slow
def test_the_s3_server_writes_its_logs_sockets_and_scratch_in_its_own_directory(tmp_path: Path) -> None:
    """SeaweedFS puts its logs, its two local sockets and a scratch directory in the machine's temporary directory
    unless told otherwise: every test session and bench run left them in /tmp."""
    import tempfile

    from bench.seaweed import s3_server

    with s3_server(tmp_path) as server:
        port = server.endpoint.rsplit(":", 1)[1]
        shared = Path(tempfile.gettempdir())
        assert not (shared / f"seaweedfs-s3-{port}.sock").exists(), (
            "its S3 socket is in the machine's temporary directory"
        )
        assert (tmp_path / "s3.sock").is_socket() and (tmp_path / "filer.sock").is_socket()
        logs = [path for path in tmp_path.iterdir() if path.name.startswith("weed.") and ".log." in path.name]
        assert logs, "its logs are not in its directory"
        assert not list(shared.glob(f"weed.*.log.*.{logs[0].name.rsplit('.', 1)[1]}")), "its logs are in /tmp too"
        assert [path for path in tmp_path.iterdir() if path.is_dir() and path.name != "data"], "no scratch directory"


def test_an_s3_server_slow_to_open_its_port_is_waited_for_to_its_deadline(tmp_path: Path, monkeypatch) -> None:
    """On a loaded machine `weed mini` opened its S3 port after botocore's own retries had given up: the start waits
    for the server to its own deadline, then fails naming the server's log, not on the first refused connection."""
    from bench import seaweed

    never_listening = tmp_path / "weed"
    never_listening.write_text("#!/bin/sh\necho 'still starting'\nexec sleep 60\n")
    never_listening.chmod(0o755)
    monkeypatch.setattr(seaweed, "WEED", never_listening)
    monkeypatch.setattr(seaweed, "START_TIMEOUT_S", 3.0)
    began = time.monotonic()
    with pytest.raises(AssertionError, match="still starting"), seaweed.s3_server(tmp_path / "s3"):
        pass
    assert time.monotonic() - began >= 3.0


@pytest.mark.slow
def test_a_missing_bucket_is_refused_and_not_created(s3: S3Server, monkeypatch) -> None:
    for key, value in s3.environ().items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StoreError, match=r"s3://no-such-bucket/runs: the bucket does not exist \(NoSuchBucket\)"):
        check_store(open_store("s3://no-such-bucket/runs"))
    assert "no-such-bucket" not in open_store(f"s3://{BUCKET}").fs.ls("", detail=False)


UPLOAD = """
import sys
from pathlib import Path
from textsql.store.location import open_store
from textsql.store.sync import upload_checkpoint
upload_checkpoint(open_store(sys.argv[1]), Path(sys.argv[2]))
"""


@pytest.mark.slow
def test_an_upload_killed_half_way_leaves_no_checkpoint_marked_complete(
    s3: S3Server, tmp_path: Path, monkeypatch
) -> None:
    for key, value in s3.environ().items():
        monkeypatch.setenv(key, value)
    uri = f"s3://{BUCKET}/store-test/killed"
    store = open_store(uri)
    upload_checkpoint(store, fake_checkpoint(tmp_path / "run", 2))
    big = fake_checkpoint(tmp_path / "run", 4, shards=200, shard_bytes=500_000)
    env = os.environ | {"PYTHONPATH": str(PROJECT_DIR)}
    uploading = subprocess.Popen([sys.executable, "-c", UPLOAD, uri, str(big)], env=env)
    deadline = time.monotonic() + 120
    while not store.fs.glob(store.path("checkpoint-4", "global_step4", "shard_*")):
        assert uploading.poll() is None and time.monotonic() < deadline, "the upload ended before it could be killed"
        store.fs.invalidate_cache()
        time.sleep(0.05)
    uploading.send_signal(signal.SIGKILL)
    uploading.wait()
    store.fs.invalidate_cache()
    copied = store.fs.glob(store.path("checkpoint-4", "global_step4", "shard_*"))
    assert 0 < len(copied) < 200, "the kill came after the upload"
    assert not store.fs.exists(store.path("checkpoint-4", COMPLETE_MARKER))
    assert complete_steps(store) == [2]
    assert download_newest(store, tmp_path / "fresh") == tmp_path / "fresh" / "checkpoint-2"
    # The next upload of the same step completes it.
    upload_checkpoint(store, big)
    assert complete_steps(store) == [2, 4]


@pytest.mark.slow
def test_textsql_train_uploads_each_checkpoint_and_the_model_to_a_local_store(
    prepared_sample: Path, tmp_path: Path
) -> None:
    from bench.tiny_run import tiny_run_argv

    uri = f"file://{tmp_path / 'store'}"
    train_args = tiny_run_argv(prepared_sample, tmp_path / "out", max_steps=2, eval_every=None, save_steps=1)
    textsql_train(["--checkpoint-store", uri, *train_args])
    store = open_store(uri)
    assert complete_steps(store) == [1, 2]
    assert (tmp_path / "store" / "model" / "config.json").is_file()
    assert (tmp_path / "store" / "run.json").is_file()


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_upload_that_keeps_failing_ends_in_one_line_naming_the_store(tmp_path: Path, monkeypatch) -> None:
    from textsql.store.uploads import StoreUploads

    store = open_store(f"file://{tmp_path / 'store'}")
    fake_checkpoint(tmp_path / "run", 2)
    tries = []

    def refused(*args, **kwargs):
        tries.append(args)
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(store.fs, "open", refused)
    with StoreUploads(store, tmp_path / "run", poll_s=0.05, tries=3, backoff_s=0.01) as uploads:
        wait_for(uploads.failed)
        with pytest.raises(StoreError) as ended:
            uploads.finish()
    assert len(tries) == 3
    assert str(ended.value) == (
        f"checkpoint store file://{tmp_path / 'store'}: uploading checkpoint-2 failed 3 times: "
        "ConnectionResetError: connection reset by peer"
    )
    assert complete_steps(store) == []


def test_a_checkpoint_without_every_ranks_files_ends_the_run_and_is_not_uploaded(tmp_path: Path) -> None:
    """Hosts that do not share the run directory: the master sees rank 0's files only. Uploaded, the store would
    hold a checkpoint marked complete that no run can resume."""
    from textsql.store.uploads import StoreUploads

    store = open_store(f"file://{tmp_path / 'store'}")
    checkpoint = fake_checkpoint(tmp_path / "run", 2)
    (checkpoint / "rng_state_0.pth").write_bytes(b"rank 0")
    with StoreUploads(store, tmp_path / "run", poll_s=0.05) as uploads:
        uploads.ranks = 2
        wait_for(uploads.failed)
        with pytest.raises(StoreError) as ended:
            uploads.finish()
    assert str(ended.value).startswith(
        f"checkpoint store file://{tmp_path / 'store'}: {checkpoint} lacks the files of rank(s) 1 of 2"
    )
    assert "give every host the same shared run directory" in str(ended.value) and "\n" not in str(ended.value)
    assert complete_steps(store) == []

    (checkpoint / "rng_state_1.pth").write_bytes(b"rank 1")  # a shared run directory: every rank's files
    with StoreUploads(store, tmp_path / "run", poll_s=0.05) as uploads:
        uploads.ranks = 2
        wait_for(lambda: complete_steps(store) == [2])
        uploads.finish()


def test_a_checkpoint_rotated_away_during_its_upload_is_skipped_and_the_next_uploaded(tmp_path: Path) -> None:
    import shutil

    from textsql.store.uploads import StoreUploads

    store = open_store(f"file://{tmp_path / 'store'}")
    older, newer = fake_checkpoint(tmp_path / "run", 2), fake_checkpoint(tmp_path / "run", 4)
    opened = store.fs.open

    def rotating(path, *args, **kwargs):
        if f"/{older.name}/" in path and older.exists():
            shutil.rmtree(older)  # the trainer's save_total_limit, while the upload runs
        return opened(path, *args, **kwargs)

    object.__setattr__(store.fs, "open", rotating)
    with StoreUploads(store, tmp_path / "run", poll_s=0.05, backoff_s=0.01) as uploads:
        uploads.finish()
    assert complete_steps(store) == [4] and not uploads.failed()
    assert [entry["name"] for entry in uploads.record["checkpoints"]] == [newer.name]


def test_each_upload_is_a_line_the_demos_terminal_shows_between_its_bar_redraws(tmp_path: Path, capsys) -> None:
    import io

    from textsql.display.terminal import StageView
    from textsql.store.uploads import StoreUploads

    store = open_store(f"file://{tmp_path / 'store'}")
    fake_checkpoint(tmp_path / "run", 2, shard_bytes=300_000)
    with StoreUploads(store, tmp_path / "run", poll_s=0.05) as uploads:
        uploads.finish()
    printed = capsys.readouterr().out
    terminal = io.StringIO()
    view = StageView(total=3, stream=terminal, live=False, tick_s=None)
    with view.stage("02_train_distributed"):
        view.feed(printed)
    shown = [line.strip() for line in terminal.getvalue().splitlines() if "checkpoint store" in line]
    assert len(shown) == 1 and shown[0].startswith(
        f"checkpoint store: checkpoint-2 uploaded to {store.uri} (0.3 MB in "
    )


def test_a_store_holding_a_previous_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    from textsql.store.uploads import store_uploads

    uri = f"file://{tmp_path / 'store'}"
    upload_checkpoint(open_store(uri), fake_checkpoint(tmp_path / "old", 2))
    with pytest.raises(StoreError) as refused, store_uploads(uri, tmp_path / "run"):
        pass
    assert str(refused.value) == (
        f"checkpoint store {uri} holds checkpoint-2 of a previous run; pass --resume-from-checkpoint auto to resume it, "
        "--overwrite-output-dir to replace it, or another store prefix"
    )
    with store_uploads(uri, tmp_path / "run", resume_from_checkpoint="auto") as uploads:
        assert uploads is not None and (tmp_path / "run" / "checkpoint-2").is_dir()
    with store_uploads(uri, tmp_path / "fresh", overwrite=True):
        assert complete_steps(open_store(uri)) == []


def test_a_local_store_is_a_writable_directory_and_its_download_is_news_not_a_warning(tmp_path: Path, caplog) -> None:
    from textsql.store.uploads import store_uploads

    uri = f"file://{tmp_path / 'store'}"
    upload_checkpoint(open_store(uri), fake_checkpoint(tmp_path / "old", 2))
    with (
        caplog.at_level(logging.INFO, logger="textsql.store"),
        store_uploads(uri, tmp_path / "run", resume_from_checkpoint="auto"),
    ):
        pass
    said = {record.getMessage(): record.levelname for record in caplog.records}
    assert said[f"checkpoint store {uri}: directory writable"] == "INFO"
    (downloaded,) = [message for message in said if "downloaded from" in message]
    assert said[downloaded] == "INFO"
    assert not [message for message in said if "bucket" in message]


def test_the_supervisor_tells_the_uploads_how_many_ranks_write_each_launchs_checkpoints(
    tmp_path: Path, monkeypatch
) -> None:
    """The uploads check each checkpoint for every rank's files: the supervisor gives them the launch's world size
    (the hostfile's slots) before it launches."""
    import io

    from textsql.launching import supervisor as supervised
    from textsql.launching.command import LaunchArguments
    from textsql.launching.training_plan import TrainingPlan
    from textsql.store.uploads import StoreUploads

    (tmp_path / "hostfile").write_text("127.0.0.2 slots=2\n127.0.0.3 slots=1\n")
    uploads = StoreUploads(open_store(f"file://{tmp_path / 'store'}"), tmp_path / "out")
    seen = []

    def launch(arguments, plan, stream=None, should_stop=None):
        seen.append(uploads.ranks)
        return 0

    monkeypatch.setattr(supervised, "launch", launch)
    arguments = LaunchArguments(run_dir=tmp_path, module="json.tool")
    assert supervised.Supervisor(arguments, uploads=uploads, stream=io.StringIO(), plan=TrainingPlan()).run() == 0
    assert seen == [3]
