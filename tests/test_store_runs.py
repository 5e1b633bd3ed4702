"""Two-worker runs with a checkpoint store on a real S3 server (SeaweedFS): every checkpoint and the model go to the
store and no credential leaks; a fresh launch with an empty run directory resumes from the store alone and ends
at the loss of an uninterrupted run; bad keys end `textsql launch` in one line before any rank starts; the guide's
commands (docs/guides/checkpoint-store.md) run as written. A demo continued on a new machine from its store:
test_demo_continuation.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.doc_blocks import page_blocks, ran
from helpers.launch import SecretWatch, on_cluster, textsql_launch
from helpers.paths import PROJECT_DIR

from bench.seaweed import BUCKET, S3Server
from bench.tiny_run import tiny_run_argv
from textsql.constants import LAUNCH_LOG_NAME, RUN_SUMMARY_NAME
from textsql.rundir.checkpoints import COMPLETE_MARKER
from textsql.store.location import open_store
from textsql.store.sync import complete_steps

pytestmark = pytest.mark.slow

GUIDE = PROJECT_DIR / "docs" / "guides" / "checkpoint-store.md"

# Same ranks, same data order, same seed, DeepSpeed's engine state restored: a resumed run's loss matches the
# uninterrupted run's to float32 rounding (gloo's reductions run in the same order).
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    from worker.cluster import start_workers

    with start_workers("local", 2, tmp_path_factory.mktemp("store-run") / "run", timeout=120) as cluster:
        yield cluster


def launch_with_store(
    workers, s3: S3Server, data: Path, output: Path, uri: str, max_steps: int, **values: object
) -> subprocess.CompletedProcess:
    train_args = tiny_run_argv(data, output, max_steps=max_steps, eval_every=None, save_steps=2, **values)
    with SecretWatch(s3.secret_key) as watch:
        result = subprocess.run(
            [*textsql_launch(output, *on_cluster(workers.run_dir)), "--checkpoint-store", uri, "--", *train_args],
            check=False,
            env=os.environ | s3.environ() | {"OMP_NUM_THREADS": "1"},
            cwd=PROJECT_DIR,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert watch.holding == [], "the store's secret was on a command line"
    assert s3.secret_key not in result.stdout + result.stderr
    return result


def loss_at(output: Path, step: int) -> float:
    history = json.loads((output / RUN_SUMMARY_NAME).read_text())["log_history"]
    return next(entry["loss"] for entry in history if entry.get("step") == step and "loss" in entry)


@pytest.fixture(scope="module")
def uninterrupted(workers, s3: S3Server, train_data: Path, tmp_path_factory) -> Path:
    """A 6-step run, a checkpoint every 2 steps, the store keeping 2 (save_total_limit)."""
    output = tmp_path_factory.mktemp("uninterrupted") / "out"
    result = launch_with_store(
        workers, s3, train_data, output, f"s3://{BUCKET}/runs/whole", max_steps=6, save_total_limit=2
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return output


def test_a_two_worker_run_uploads_every_checkpoint_and_the_model_and_leaks_no_secret(
    uninterrupted: Path, s3: S3Server, workers, monkeypatch
) -> None:
    for key, value in s3.environ().items():
        monkeypatch.setenv(key, value)
    store = open_store(f"s3://{BUCKET}/runs/whole")
    assert complete_steps(store) == [4, 6], "the store keeps save_total_limit's newest"
    names = {path.rpartition("/")[2] for path in store.fs.find(store.path("model"))}
    assert {"config.json", "model.safetensors", "README.md"} <= names
    record = json.loads(store.fs.cat(store.path(RUN_SUMMARY_NAME)))["checkpoint_store"]
    assert record["store"] == f"s3://{BUCKET}/runs/whole"
    assert "checkpoint-6" in [entry["name"] for entry in record["checkpoints"]]
    assert all(entry["bytes"] > 0 and entry["seconds"] >= 0 for entry in record["checkpoints"])
    for path in [*workers.run_dir.rglob("*"), *uninterrupted.rglob("*")]:
        if path.is_file():
            assert s3.secret_key.encode() not in path.read_bytes(), f"the store's secret is in {path}"


def test_a_fresh_launch_resumes_from_the_store_alone_to_the_uninterrupted_loss(
    uninterrupted: Path, s3: S3Server, workers, train_data: Path, tmp_path: Path, monkeypatch
) -> None:
    for key, value in s3.environ().items():
        monkeypatch.setenv(key, value)
    # The store of a run lost after step 4: its checkpoint-4 marked complete, checkpoint-6 cut off half-way.
    whole, lost = open_store(f"s3://{BUCKET}/runs/whole"), open_store(f"s3://{BUCKET}/runs/lost")
    whole.fs.copy(whole.path("checkpoint-4"), lost.path("checkpoint-4"), recursive=True)
    states = whole.fs.glob(whole.path("checkpoint-6", "global_step6", "*"))
    whole.fs.copy(states[:1], [lost.path("checkpoint-6", "global_step6", states[0].rpartition("/")[2])])
    assert complete_steps(lost) == [4]
    output = tmp_path / "out"  # a new machine: no run directory
    resumed = launch_with_store(workers, s3, train_data, output, lost.uri, max_steps=6, resume_from_checkpoint="auto")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    assert "checkpoint-4 downloaded from" in resumed.stdout + resumed.stderr
    summary = json.loads((output / RUN_SUMMARY_NAME).read_text())
    assert Path(summary["resumed_from"]).name == "checkpoint-4" and summary["global_step"] == 6
    assert loss_at(output, 6) == pytest.approx(loss_at(uninterrupted, 6), rel=LOSS_TOLERANCE)
    assert complete_steps(lost) == [4, 6], "the resumed run's checkpoint-6 replaced the cut-off one"


def test_wrong_keys_end_the_launch_in_one_line_before_any_rank_starts(
    s3: S3Server, workers, train_data: Path, tmp_path: Path
) -> None:
    train_args = tiny_run_argv(train_data, tmp_path / "out", max_steps=2, eval_every=None)
    launch_log = tmp_path / "out" / LAUNCH_LOG_NAME
    before = launch_log.read_text() if launch_log.exists() else ""
    result = subprocess.run(
        [
            *textsql_launch(tmp_path / "out", *on_cluster(workers.run_dir)),
            "--checkpoint-store",
            f"s3://{BUCKET}/runs/refused",
            "--",
            *train_args,
        ],
        check=False,
        env=os.environ | s3.environ(secret="wrong-secret-value"),
        cwd=PROJECT_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: checkpoint store s3://{BUCKET}/runs/refused: the secret key does not match the access key "
        "(SignatureDoesNotMatch): check AWS_SECRET_ACCESS_KEY"
    )
    assert (launch_log.read_text() if launch_log.exists() else "") == before, "a launch started"
    assert "wrong-secret-value" not in result.stdout + result.stderr


def test_the_guides_commands_train_into_a_store_and_resume_from_it_in_a_new_run_directory(reader_project: Path) -> None:
    """The guide's two blocks as tests/test_docs_blocks.py runs them (once a session, in the reader's copy): what they
    print and leave."""
    blocks = page_blocks(GUIDE)
    assert len(blocks) == 2, "the guide's runnable blocks: train into the store, resume from it"
    said = [ran(block, reader_project) for block in blocks]
    assert "checkpoint store: checkpoint-2 uploaded to file://" in said[0].stdout + said[0].stderr
    assert "checkpoint store: checkpoint-4 downloaded from" in said[1].stdout + said[1].stderr
    store = reader_project / "runs" / "checkpoint-store"
    assert (store / "checkpoint-6" / COMPLETE_MARKER).is_file() and (store / "model" / "README.md").is_file()
    assert json.loads((reader_project / "runs" / "store-r2" / RUN_SUMMARY_NAME).read_text())["global_step"] == 6
