"""The time-to-accuracy figure's parts on the CPU (bench/accuracy.py): the held-out task as training evaluates it, when
a record reached the target, and the step clock that stops a run at a score or a time cap. Both arms run end to end
in the checkout's rehearsal (tests/test_bench_checkout.py)."""

import dataclasses
import json
from types import SimpleNamespace

import datasets
import numpy as np
import pytest

from bench.accuracy import LF_METRIC, common_score, held_out_task, reached
from bench.steps import StepClock
from textsql.data.tables import prepared_tables_path
from textsql.training.metrics import EVAL_SPLIT, eval_questions


def clock_record(ends: list[float], evaluations: list[tuple[int, float | None, float]]) -> dict:
    """Steps beginning at 0 and ending at ``ends``; evaluations as (step, LF, seconds)."""
    return {
        "step_began": [0.0] + ends[:-1],
        "step_ended": ends,
        "evaluations": [
            {"step": step, "eval_loss": 1.0, "seconds": seconds, "metrics": {} if lf is None else {LF_METRIC: lf}}
            for step, lf, seconds in evaluations
        ],
    }


def test_the_time_to_the_target_leaves_out_the_evaluations_before_it_and_the_wall_time_keeps_them():
    # Steps of 1 s; evaluations of 10 s after steps 2 and 4 (the clock reads them in the next steps' ends).
    record = clock_record([1.0, 2.0, 13.0, 14.0, 25.0], [(2, 0.4, 10.0), (4, 0.72, 10.0)])
    points = [
        {"step": 2, "lf_accuracy": 0.4, "training_s": 2.0, "wall_s": 12.0},
        {"step": 4, "lf_accuracy": 0.72, "training_s": 4.0, "wall_s": 24.0},
    ]
    assert reached(record, 0.7) == {"reached": True, **points[1], "curve": points}
    assert reached(record, 0.9) == {
        "reached": False,
        "steps": 5,
        "best_lf_accuracy": 0.72,
        "training_s": 5.0,
        "evaluations": 2,
        "curve": points,
    }
    assert reached(clock_record([1.0], [(1, None, 1.0)]), 0.7)["best_lf_accuracy"] is None
    # A final evaluation after the last step (the defaults' run evaluates once more) is no training time spent.
    finished = clock_record([1.0, 2.0, 13.0, 14.0, 25.0], [(2, 0.4, 10.0), (4, 0.5, 10.0), (5, 0.6, 10.0)])
    assert reached(finished, 0.7)["training_s"] == 5.0 and reached(finished, 0.7)["best_lf_accuracy"] == 0.6


def test_the_step_clock_stops_at_a_score_or_past_its_time_cap():
    state = SimpleNamespace(global_step=1)
    scored = StepClock(stop_at=(LF_METRIC, 0.7))
    control = SimpleNamespace(should_training_stop=False)
    scored.on_step_begin(None, state, control)
    scored.on_step_end(None, state, control)
    scored.on_evaluate(None, state, control, metrics={LF_METRIC: 0.69, "eval_loss": 2.0, "epoch": 1})
    assert not control.should_training_stop and scored.evaluations[0]["metrics"] == {LF_METRIC: 0.69, "eval_loss": 2.0}
    scored.on_evaluate(None, state, control, metrics={LF_METRIC: np.float32(0.75)})  # numpy's scores count too
    assert control.should_training_stop and scored.evaluations[1]["metrics"] == {LF_METRIC: 0.75}

    capped = StepClock(time_cap_s=0.0)
    control = SimpleNamespace(should_training_stop=False)
    capped.on_step_begin(None, state, control)
    capped.on_step_end(None, state, control)
    assert control.should_training_stop
    uncapped = StepClock(time_cap_s=3600.0)
    control = SimpleNamespace(should_training_stop=False)
    uncapped.on_step_begin(None, state, control)
    uncapped.on_step_end(None, state, control)
    assert not control.should_training_stop


@pytest.mark.timeout(300)
def test_the_held_out_task_is_the_synthetic_test_split_where_training_evaluates(tmp_path):
    """The demo's questions, its 1,000 held-out ones (here the first 16) as the split training evaluates, with their
    tables: questions over tables no training question uses."""
    data = held_out_task(tmp_path, limit=16)
    loaded = datasets.load_from_disk(str(data))
    synthetic = datasets.load_from_disk(str(tmp_path / "synthetic"))
    assert set(loaded) == {"train", EVAL_SPLIT} and loaded[EVAL_SPLIT]["id"] == synthetic["test"]["id"]
    questions, tables = eval_questions(data, None)
    assert len(questions) == 16 and tables and {question["table_id"] for question in questions} <= set(tables)
    assert not {question["table_id"] for question in questions} & set(loaded["train"]["table_id"])
    assert prepared_tables_path(data, "train").is_file()
    assert held_out_task(tmp_path, limit=16) == data  # built once


def test_the_command_trains_the_demos_model_in_both_arms_scoring_every_held_out_question(tmp_path, monkeypatch):
    from bench import accuracy

    # More held-out questions than the 64 textsql train evaluates unless told.
    monkeypatch.setattr(accuracy, "ACCURACY_SMOKE", dataclasses.replace(accuracy.ACCURACY_SMOKE, limit=72))
    out = tmp_path / "time_to_accuracy.json"
    assert accuracy.main(["--smoke", "--cap-s", "45", "--out", str(out)]) == 0
    figure = json.loads(out.read_text())
    assert figure["model"] == accuracy.MODEL_LABEL and figure["cap_s"] == 45.0 and figure["held_out_questions"] == 72
    ours, peer = figure["arms"]["defaults"], figure["arms"]["peer"]
    assert ours["evaluated_questions"] == peer["evaluated_questions"] == 72
    assert ours["token_budget"] == accuracy.SMOKE_TOKEN_BUDGET and "token budget 2048" in ours["label"]
    # Two steps each, evaluated after each: the smoke run's, which never reaches the target and says how far it got.
    assert (ours["steps"], ours["evaluations"], peer["steps"], peer["evaluations"]) == (2, 2, 2, 2)
    assert figure["value"] is None and figure["not_reached"] == ["defaults", "peer"]
    assert [point["step"] for point in ours["curve"]] == [point["step"] for point in peer["curve"]] == [1, 2]
    assert figure["common_score"] is None  # nothing scored, nothing to compare at
    assert ours["best_lf_accuracy"] == 0.0 and figure["releases"]["torch"]


def test_arms_that_scored_different_questions_are_refused():
    from bench.accuracy import every_question_evaluated

    every_question_evaluated("peer", {"evaluated_questions": 1000}, 1000)
    every_question_evaluated("peer", {"evaluated_questions": None}, 1000)  # stopped before its first evaluation
    with pytest.raises(RuntimeError, match="the defaults arm evaluated 64 questions, not the 1000 held out"):
        every_question_evaluated("defaults", {"evaluated_questions": 64}, 1000)


def test_short_of_the_target_the_arms_are_compared_at_the_best_score_both_reached():
    ours = [{"lf_accuracy": 0.2, "training_s": 50.0}, {"lf_accuracy": 0.35, "training_s": 100.0}]
    ours += [{"lf_accuracy": 0.55, "training_s": 300.0}]
    peer = [{"lf_accuracy": 0.1, "training_s": 200.0}, {"lf_accuracy": 0.333, "training_s": 900.0}]
    assert common_score(ours, peer) == {
        "lf_accuracy": 0.333,
        "defaults_training_s": 100.0,
        "peer_training_s": 900.0,
        "value": 9.0,
    }
    # The other way round the ratio falls below 1; an arm that scored nothing leaves nothing to compare.
    assert common_score(peer, ours)["value"] == 0.11
    assert common_score(ours, [{"lf_accuracy": 0.0, "training_s": 900.0}]) is None
    assert common_score(ours, []) is None
