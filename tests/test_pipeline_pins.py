"""What a continued training is pinned to: a change its checkpoint cannot carry (a parameter, or what ``auto`` resolved
to: profile, precision, ranks) is refused in one line that names the fix, before any notebook runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.checkpoints import complete_checkpoint
from helpers.pipeline_records import actions, record

from textsql.pipeline.demo import demo_parameters
from textsql.pipeline.manifest import PREPARE, TRAIN, Manifest, continuation_steps, manifest_path
from textsql.pipeline.parameters import NotebookError


@pytest.mark.parametrize(
    ("notebook", "parameter", "value", "shown"),
    [
        (TRAIN, "learning_rate", 0.01, "learning_rate (None -> 0.01)"),
        (TRAIN, "model", "t5-small", "model ('default' -> 't5-small')"),
        (PREPARE, "source", "sample", "source ('synthetic' -> 'sample')"),
    ],
)
def test_a_change_a_checkpoint_cannot_take_is_refused_in_one_line(tmp_path, notebook, parameter, value, shown):
    chosen = demo_parameters(tmp_path)
    manifest = Manifest(tmp_path)
    record(manifest, chosen, PREPARE)
    record(manifest, chosen, TRAIN, completed=False)
    complete_checkpoint(tmp_path, 2)
    changed = {**chosen, notebook: {**chosen[notebook], parameter: value}}
    with pytest.raises(NotebookError) as refused:
        continuation_steps(manifest, changed)
    assert str(refused.value) == (
        f"cannot resume {TRAIN} from checkpoint-2, which was trained before {shown} changed; "
        "set it back to resume, or overwrite_output_dir=true to train from step 0"
    )
    changed[TRAIN] = {**changed[TRAIN], "overwrite_output_dir": True}
    assert continuation_steps(manifest, changed)[TRAIN].extra == {
        "resume_from_checkpoint": None,
        "overwrite_output_dir": True,
    }, "the fix it names"


def zero_checkpoint(run_dir: Path, step: int, ranks: int) -> Path:
    """A complete ZeRO-1 checkpoint written by ``ranks`` ranks: one optimizer shard each."""
    checkpoint = complete_checkpoint(run_dir, step)
    for rank in range(ranks):
        (checkpoint / f"global_step{step}" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text("")
    return checkpoint


def test_a_continuation_pins_what_training_resolved_to_not_the_parameters(tmp_path):
    chosen = demo_parameters(tmp_path)
    manifest = Manifest(tmp_path)
    record(manifest, chosen, PREPARE)
    record(manifest, chosen, TRAIN, completed=False)
    checkpoint = zero_checkpoint(tmp_path, 2, ranks=2)
    recorded = json.loads(manifest_path(tmp_path).read_text())["notebooks"][TRAIN]
    assert recorded["resolved"] == {"profile": "zero1", "precision": "fp32", "ranks": 2}, "auto on two CPU workers"

    on_gpus = {**chosen, TRAIN: {**chosen[TRAIN], "workers": 4, "worker_gpus": 1}}
    with pytest.raises(NotebookError) as refused:
        continuation_steps(manifest, on_gpus)
    assert str(refused.value) == (
        f"cannot resume {TRAIN} from checkpoint-2, which was trained before the profile it resolved to "
        "('zero1' -> 'zero0'), the precision it resolved to ('fp32' -> 'bf16 or fp32, by the GPU'), its ranks, "
        "workers x worker_gpus (2 -> 4) changed; set them back to resume, or overwrite_output_dir=true to train "
        "from step 0"
    )
    more = {**chosen, TRAIN: {**chosen[TRAIN], "workers": 4}}
    with pytest.raises(NotebookError, match=r"before its ranks, workers x worker_gpus \(2 -> 4\) changed; set it"):
        continuation_steps(manifest, more)
    # Converted to a universal checkpoint, it loads at any number of ranks (textsql.rundir.universal).
    (checkpoint / "global_step2_universal" / "zero").mkdir(parents=True)
    (checkpoint / "latest_universal").write_text("global_step2_universal")
    assert actions(continuation_steps(manifest, more)) == ["skip", "relaunch", "run"]


def test_gpus_for_the_workers_change_the_precision_auto_resolves_to_and_are_refused(tmp_path):
    """The same profile and ranks, given by name: only the device changes, and with it what precision auto is."""
    chosen = demo_parameters(tmp_path)
    chosen[TRAIN] |= {"profile": "zero1"}
    manifest = Manifest(tmp_path)
    record(manifest, chosen, PREPARE)
    record(manifest, chosen, TRAIN, completed=False)
    zero_checkpoint(tmp_path, 2, ranks=2)
    with pytest.raises(NotebookError) as refused:
        continuation_steps(manifest, {**chosen, TRAIN: {**chosen[TRAIN], "worker_gpus": 1}})
    assert str(refused.value) == (
        f"cannot resume {TRAIN} from checkpoint-2, which was trained before the precision it resolved to "
        "('fp32' -> 'bf16 or fp32, by the GPU') changed; set it back to resume, or overwrite_output_dir=true to "
        "train from step 0"
    )
    del manifest.records[TRAIN]["resolved"]["precision"]  # a record from before the precision was kept
    assert actions(continuation_steps(manifest, {**chosen, TRAIN: {**chosen[TRAIN], "worker_gpus": 1}}))[1] == (
        "relaunch"
    )


def test_a_record_from_before_resolved_values_compares_only_its_parameters(tmp_path):
    chosen = demo_parameters(tmp_path)
    manifest = Manifest(tmp_path)
    record(manifest, chosen, PREPARE)
    record(manifest, chosen, TRAIN, completed=False)
    del manifest.records[TRAIN]["resolved"]
    manifest.save()
    zero_checkpoint(tmp_path, 2, ranks=2)
    older = Manifest.load(tmp_path)
    steps = continuation_steps(older, {**chosen, TRAIN: {**chosen[TRAIN], "workers": 4}})
    assert actions(steps) == ["skip", "relaunch", "run"], "nothing recorded to compare the ranks with"
    with pytest.raises(NotebookError, match=r"before profile \('auto' -> 'zero0'\) changed"):
        continuation_steps(older, {**chosen, TRAIN: {**chosen[TRAIN], "profile": "zero0"}})
