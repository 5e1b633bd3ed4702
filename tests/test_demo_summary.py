"""The demo's closing summary: each score beside its standard error, read from files the pods can write."""

from textsql.json_files import write_json
from textsql.pipeline.demo import DemoResult, format_summary


def summary_of(tmp_path, metrics: dict) -> str:
    out = tmp_path / "demo"
    write_json(out / "run.json", {"log_history": [{"train_runtime": 5.0}], "world_size": 2, "zero_stage": 1})
    write_json(out / "metrics.json", metrics)
    return format_summary(DemoResult(out, {"02_train_distributed": 1.0}, {"02_train_distributed": out}))


def test_each_score_is_shown_with_its_standard_error(tmp_path):
    metrics = {
        "n": 1000,
        "lf_accuracy": 0.5,
        "ex_accuracy": 0.6,
        "lf_standard_error": 0.0158,
        "ex_standard_error": 0.0149,
    }
    assert "Scores on 1000 prepared questions: logical form 50.0% ± 1.6, execution 60.0% ± 1.5" in (
        summary_of(tmp_path, metrics)
    )


def test_a_standard_error_that_is_no_number_is_left_out_not_repeated(tmp_path):
    """``100 * "x"`` is a hundred x's: a pod's metrics.json gets no such lever on the master's terminal."""
    metrics = {"n": 10, "lf_accuracy": 0.5, "ex_accuracy": None, "lf_standard_error": "x"}
    shown = summary_of(tmp_path, metrics)
    assert "logical form 50.0%, execution n/a" in shown and "xx" not in shown
