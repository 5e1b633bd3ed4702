"""Smoke test of the benchmarks: one figure at its smallest size, so the bench code cannot rot.

It measures nothing worth reading (speed claims live in bench/README.md, produced by `make bench`);
it checks that the figure runs end to end and that results.json and README.md carry its keys.
"""

import pytest
from helpers.bench import run_bench

# The bench in a fresh Python; its rendezvous figure starts real worker agents.
pytestmark = pytest.mark.slow


def test_bench_smoke_writes_results_and_table(tmp_path):
    results = run_bench(tmp_path, "--only", "rendezvous", timeout=300)
    assert {"machine", "releases", "started", "finished"} <= set(results)
    assert results["releases"]["deepspeed"] and results["machine"]["cores"] >= 1
    figure = results["rendezvous_4_workers_s"]
    assert figure["value"] > 0 and figure["seconds"]["runs"] and "register-only" in figure["method"]
    readme = (tmp_path / "README.md").read_text()
    assert "| release |" in readme and "deepspeed" in readme


def test_bench_smoke_compares_constrained_and_free_inference(tmp_path):
    figure = run_bench(tmp_path, "--only", "constrained", timeout=300)["infer_constrained_over_free"]
    assert figure["value"] > 0 and set(figure["examples_per_s"]) == {"free", "constrained"}
    assert figure["parse_rate"]["constrained"] == 1.0
    assert "parsed: free" in (tmp_path / "README.md").read_text()


def test_bench_smoke_times_the_served_model_cold_and_warm(tmp_path):
    figure = run_bench(tmp_path, "model-latency", timeout=600)["model_latency_s"]
    assert set(figure["models"]) == {"t5-tiny (embedded)", "t5-small shape"} and figure["budget_s"] == 1.0
    for measured in figure["models"].values():
        # Both timed, no order between them asserted: on a machine shared with other work a warm answer can take
        # longer than the cold one (a timed assertion fails with the machine's load, not with the code).
        assert measured["cold_s"] > 0 and measured["warm_s"]["median"] > 0 and measured["warm_s"]["n"] == 2
        assert measured["example_sql"].startswith("SELECT ") and measured["tokens_median"] > 0
