"""The rate-scaling figure (bench/rate_scaling.py): the summary over seeds, and the command end to end on the smoke
task, each run at the rate it was given."""

import json

from bench.rate_scaling import rate_summary


def test_a_rates_summary_counts_the_seeds_that_reached_the_target_and_spans_each_evaluation():
    def run(reached_at: int | None, scores: list[float]) -> dict:
        curve = [{"step": 100 * (index + 1), "lf_accuracy": score} for index, score in enumerate(scores)]
        return {"reached": reached_at is not None, "curve": curve} | ({"step": reached_at} if reached_at else {})

    summary = rate_summary({"42": run(300, [0.1, 0.5, 0.72]), "7": run(200, [0.3, 0.71]), "1": run(None, [0.0, 0.2])})
    assert (summary["runs"], summary["reached"]) == (3, 2)
    assert summary["steps_to_target"] == {"mean": 250, "min": 200, "max": 300}
    assert summary["lf_accuracy_by_step"] == [
        {"step": 100, "runs": 3, "mean": 0.1333, "min": 0.0, "max": 0.3},
        {"step": 200, "runs": 3, "mean": 0.47, "min": 0.2, "max": 0.71},
        {"step": 300, "runs": 1, "mean": 0.72, "min": 0.72, "max": 0.72},  # the others stopped or ended before it
    ]
    assert rate_summary({"1": run(None, [0.0])})["steps_to_target"] is None


def test_the_command_trains_each_seed_at_each_rate_it_is_given(tmp_path):
    from bench import rate_scaling

    out = tmp_path / "rate_scaling.json"
    assert rate_scaling.main(["--smoke", "--rates", "0.002,0.0005", "--seeds", "3", "--out", str(out)]) == 0
    figure = json.loads(out.read_text())
    assert list(figure["rates"]) == ["0.002", "0.0005"] and figure["token_budget"] == 2048
    for rate, entry in figure["rates"].items():
        (seed,) = entry["runs"]
        assert seed == "3" and f"at {rate}, " in entry["runs"][seed]["label"]
        assert entry["summary"]["runs"] == 1 and entry["runs"][seed]["evaluated_questions"] == 16
