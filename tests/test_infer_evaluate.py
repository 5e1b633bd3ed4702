"""`textsql evaluate` scores a predictions file as `textsql infer` did: the same questions, gold queries and tables,
so the same numbers (execution accuracy too) from both commands on one file, whatever the questions came from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from textsql.cli import cli
from textsql.cli.inference import NO_TABLES_HINT
from textsql.data.prepare import PrepareArguments, prepare
from textsql.data.wikisql import load_split

QUESTIONS = 3
# The untrained embedded T5 writes any query: a few tokens each, greedy, are enough to score.
QUICK = ("--model", "default", "--device", "cpu", "--num-beams", "1", "--max-new-tokens", "8", "--limit", "3")


@pytest.fixture(scope="module")
def synthetic_data(tmp_path_factory) -> Path:
    """Synthetic questions prepared: their tables carry rows, so execution accuracy is scored."""
    out = tmp_path_factory.mktemp("agree") / "data"
    prepare(PrepareArguments(source="synthetic", data_dir=str(out), limit=8))
    return out


def questions_file(directory: Path) -> Path:
    """Our records, each carrying its table's rows."""
    records, tables = load_split("synthetic", "validation", QUESTIONS)
    path = directory / "questions.jsonl"
    lines = [
        json.dumps(record | {key: tables[record["table_id"]][key] for key in ("types", "rows")}) for record in records
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def infer(run: Path, *questions: str) -> dict:
    """`textsql infer` into ``run``; the metrics it wrote, less what only infer knows (its timing)."""
    result = CliRunner().invoke(
        cli, ["infer", *QUICK, "--split", "validation", "--predictions-file", str(run / "p.jsonl"), *questions]
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads((run / "metrics.json").read_text())
    del metrics["inference"]
    return metrics


def evaluate(predictions: Path) -> tuple[dict, str]:
    result = CliRunner().invoke(cli, ["evaluate", "--predictions-file", str(predictions), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("given", ["--data-dir", "--source", "--questions-file"])
def test_evaluate_gives_the_numbers_infer_gave_on_the_same_file(given, synthetic_data, tmp_path, monkeypatch):
    questions = {
        "--data-dir": str(synthetic_data),
        "--source": "synthetic",
        "--questions-file": str(questions_file(tmp_path)),
    }[given]
    run = tmp_path / "run"
    scored = infer(run, given, questions)
    assert scored["n"] == QUESTIONS and scored["ex_accuracy"] is not None, "the questions' tables have rows"
    monkeypatch.chdir(tmp_path)  # evaluate from elsewhere: relative paths were recorded as absolute ones
    report, said = evaluate(run / "p.jsonl")
    assert report == scored
    assert said == ""


def test_predictions_away_from_their_metrics_say_what_to_pass(synthetic_data, tmp_path):
    run = tmp_path / "run"
    infer(run, "--data-dir", str(synthetic_data))
    alone = tmp_path / "elsewhere" / "p.jsonl"
    alone.parent.mkdir()
    shutil.copy(run / "p.jsonl", alone)
    report, said = evaluate(alone)
    assert report["ex_accuracy"] is None and report["lf_accuracy"] is not None
    assert said.strip().splitlines() == [NO_TABLES_HINT]
    tables = synthetic_data / "tables" / "validation.tables.jsonl"
    result = CliRunner().invoke(cli, ["evaluate", "--predictions-file", str(alone), "--tables", str(tables), "--json"])
    assert json.loads(result.stdout)["ex_accuracy"] is not None
