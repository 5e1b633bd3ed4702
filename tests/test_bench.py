"""Smoke test of the benchmarks: one figure at its smallest size, so the bench code cannot rot.

It measures nothing worth reading (speed claims live in bench/README.md, produced by `make bench`);
it checks that the figure runs end to end and that results.json and README.md carry its keys.
"""

import json
import subprocess
import sys

from textsql.constants import PROJECT_DIR


def test_bench_smoke_writes_results_and_table(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--only",
            "rendezvous",
            "--out",
            str(tmp_path),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=PROJECT_DIR,
        check=True,
        timeout=300,
        capture_output=True,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"machine", "releases", "started", "finished"} <= set(results)
    assert results["releases"]["deepspeed"] and results["machine"]["cores"] >= 1
    figure = results["rendezvous_4_workers_s"]
    assert figure["value"] > 0 and figure["seconds"]["runs"] and "register-only" in figure["method"]
    readme = (tmp_path / "README.md").read_text()
    assert "| release |" in readme and "deepspeed" in readme


def test_bench_smoke_compares_constrained_and_free_inference(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--only",
            "constrained",
            "--out",
            str(tmp_path),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=PROJECT_DIR,
        check=True,
        timeout=300,
        capture_output=True,
    )
    figure = json.loads((tmp_path / "results.json").read_text())["infer_constrained_over_free"]
    assert figure["value"] > 0 and set(figure["examples_per_s"]) == {"free", "constrained"}
    assert figure["parse_rate"]["constrained"] == 1.0
    assert "parsed: free" in (tmp_path / "README.md").read_text()
