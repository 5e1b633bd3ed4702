"""Inference on the shipped sample: batching, order, output formats, metrics, one-question answers.

A model overfitted in-process (plain torch, a few hundred steps on eight sample questions) gives
predictions that mean something, so the tests can check that the right SQL comes back.
"""

import json
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path

import datasets
import pytest
import torch
from click.testing import CliRunner
from transformers import DataCollatorForSeq2Seq

from textsql.arguments import GenerationOptions
from textsql.cli import cli
from textsql.constants import (
    LABEL_PAD_TOKEN_ID,
    MAX_CONDITIONS,
    REAL_METRICS_NAME,
    REAL_PREDICTIONS_NAME,
    SAMPLE_DATA_DIR,
)
from textsql.data.prepare import prepare
from textsql.data.sql import canonical_sql
from textsql.data.wikisql import load_split
from textsql.errors import DataError
from textsql.inference.predict import load_questions, parse_header, predict
from textsql.inference.predictor import Predictor, ask
from textsql.json_files import read_jsonl
from textsql.model import load_model, load_tokenizer
from textsql.scoring.evaluate import evaluate
from textsql.tracking.launch_runs import MLFLOW_RUN_NAME

QUESTIONS = 8
# The fixture checks exact repetition every few steps, up to a cap (about 80 steps are needed here).
MEMORISE_CHECK_EVERY = 10
MEMORISE_MAX_STEPS = 600
CHECKED_BATCH_SIZES = (1, 3, 4, QUESTIONS)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("infer") / "data"
    prepare(data_dir=str(out), limit=QUESTIONS)
    return out


@pytest.fixture(scope="module")
def trained(prepared: Path, tmp_path_factory) -> Path:
    """The embedded small T5 trained until greedy decoding repeats every one of its eight targets.

    The tests rely on that property, so the fixture checks it (one question at a time and all in one
    batch, every few steps) instead of taking a loss threshold to imply it: where a loss is crossed
    depends on the CPU's floating-point kernels.
    """
    torch.manual_seed(0)
    tokenizer, model = load_tokenizer(), load_model()
    rows = datasets.load_from_disk(str(prepared))["validation"]
    batch = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=LABEL_PAD_TOKEN_ID)(
        list(rows.select_columns(["input_ids", "attention_mask", "labels"]))
    )
    targets = [tokenizer.decode(labels, skip_special_tokens=True).strip() for labels in rows["labels"]]
    checking = Predictor(model, tokenizer)
    check = GenerationOptions(max_new_tokens=max(len(labels) for labels in rows["labels"]) + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    unlearnt = list(range(QUESTIONS))
    for step in range(1, MEMORISE_MAX_STEPS + 1):
        model.eval()  # no dropout: memorising eight examples is the point
        with torch.enable_grad():
            model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # All eight in one batch first: a model that fails there fails the full check, which costs four times as much.
        if step % MEMORISE_CHECK_EVERY == 0 and not not_repeated(
            checking, list(rows["input_ids"]), targets, check, sizes=(QUESTIONS,)
        ):
            unlearnt = not_repeated(checking, list(rows["input_ids"]), targets, check)
            if not unlearnt:
                break
    assert not unlearnt, (
        f"after {MEMORISE_MAX_STEPS} steps the model still does not repeat these training targets: "
        + "; ".join(f"{rows[i]['question']!r} -> expected {targets[i]!r}" for i in unlearnt)
    )
    out = tmp_path_factory.mktemp("infer") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def not_repeated(
    predictor: Predictor,
    input_ids: list[list[int]],
    targets: list[str],
    options: GenerationOptions,
    sizes: tuple[int, ...] = CHECKED_BATCH_SIZES,
) -> list[int]:
    """Indexes of the questions whose greedy output is not exactly their target at some batch size of ``sizes``
    (by default every one the tests use: padding changes the arithmetic, so each is checked)."""
    outputs = [predictor.generate(input_ids, replace(options, batch_size=size)) for size in sizes]
    return [i for i, target in enumerate(targets) if any(output[i] != target for output in outputs)]


@pytest.fixture(scope="module")
def predictor(trained: Path) -> Predictor:
    return Predictor.load(trained)


@pytest.fixture(scope="module")
def input_ids(prepared: Path) -> list[list[int]]:
    return list(datasets.load_from_disk(str(prepared))["validation"]["input_ids"])


def test_batched_generation_equals_one_at_a_time_in_input_order(predictor, input_ids):
    one_by_one = predictor.generate(input_ids, GenerationOptions(batch_size=1))
    assert len(set(one_by_one)) == QUESTIONS  # all answers differ, so any order mistake shows
    assert predictor.generate(input_ids, GenerationOptions(batch_size=3)) == one_by_one
    reversed_ids = input_ids[::-1]
    assert predictor.generate(reversed_ids, GenerationOptions(batch_size=QUESTIONS)) == one_by_one[::-1]


def test_batches_are_sorted_longest_first(predictor, input_ids):
    widths, real_generate = [], predictor.model.generate

    def recording(**kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        assert kwargs["attention_mask"].sum(dim=1).max() == kwargs["input_ids"].shape[1]
        return real_generate(**kwargs)

    predictor.model.generate = recording
    try:
        predictor.generate(input_ids, GenerationOptions(batch_size=2, max_new_tokens=4))
    finally:
        del predictor.model.generate
    lengths = sorted((len(ids) for ids in input_ids), reverse=True)
    assert widths == lengths[::2]


def test_predict_writes_lines_official_format_and_metrics(predictor, prepared, tmp_path):
    out, official = tmp_path / "run" / "predictions.jsonl", tmp_path / "official.jsonl"
    summary = predict(
        predictor, prepared, "validation", out, GenerationOptions(batch_size=4), official_out=official, progress=False
    )
    lines = list(read_jsonl(out))
    assert [line["id"] for line in lines] == [f"validation-{i}" for i in range(QUESTIONS)]
    assert set(lines[0]) == {"id", "table_id", "question", "pred_sql", "query", "error", "gold_sql", "gold_query"}
    metrics = json.loads((out.parent / "metrics.json").read_text())
    assert metrics == json.loads(json.dumps(summary["metrics"]))
    # The fixture's model repeats every target, and each target reads back as its gold query.
    assert all(line["pred_sql"] == line["gold_sql"] for line in lines)
    assert metrics["n"] == QUESTIONS and metrics["lf_accuracy"] == 1.0
    assert metrics["ex_accuracy"] is None  # the sample's tables carry no rows
    # The official format lines up with the release's question file and scores the same.
    official_lines = list(read_jsonl(official))
    assert all(list(line) in (["query"], ["error"]) for line in official_lines)
    release_gold = list(read_jsonl(SAMPLE_DATA_DIR / "dev.jsonl"))[:QUESTIONS]
    assert evaluate(release_gold, official_lines)["lf_accuracy"] == metrics["lf_accuracy"]
    assert evaluate(None, lines)["lf_accuracy"] == metrics["lf_accuracy"]


def test_records_with_rows_get_execution_accuracy(predictor, tmp_path):
    records, _ = sample_records()
    for record in records:  # a hand-made row per table, so every query executes
        record["types"] = ["text"] * len(record["header"])
        record["rows"] = [[f"{name} value" for name in record["header"]], ["3"] * len(record["header"])]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    summary = predict(predictor, path, out=tmp_path / "predictions.jsonl", progress=False)
    metrics = summary["metrics"]
    assert metrics["ex_accuracy"] == metrics["lf_accuracy"] == 1.0


def test_a_trained_model_writes_only_wikisql_queries_over_unseen_tables(predictor, tmp_path):
    """Issue 13's done-when on a model that has learnt something: questions and tables it never saw
    (the sample's test split) all come out as queries over their own table, in metrics.json too."""
    summary = predict(
        predictor,
        "sample",
        "test",
        tmp_path / "predictions.jsonl",
        GenerationOptions(batch_size=16, max_new_tokens=48),
        progress=False,
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["n"] == 100 and metrics["parse_rate"] == 1.0
    for line, record in zip(read_jsonl(summary["predictions"]), load_split("sample", "test")[0]):
        columns = [line["query"]["sel"], *(col for col, _, _ in line["query"]["conds"])]
        assert all(0 <= col < len(record["header"]) for col in columns), line
        assert len(set(columns)) == len(columns) <= 1 + MAX_CONDITIONS, line


def sample_records():
    return load_split("sample", "validation", QUESTIONS)


def test_ask_answers_a_written_question(trained):
    records, _ = sample_records()
    record = records[1]
    answer = ask(trained, record["question"], record["header"])
    assert answer["error"] is None
    assert answer["query"] == canonical_sql(record["sql"])


def test_cli_question_and_split(trained, prepared, tmp_path):
    records, _ = sample_records()
    record = records[0]
    runner = CliRunner()
    answer = runner.invoke(
        cli,
        ["infer", "--model", str(trained), "--question", record["question"], "--header", json.dumps(record["header"])],
    )
    assert answer.exit_code == 0, answer.output
    assert json.loads(answer.stdout)["query"] == canonical_sql(record["sql"])
    out = tmp_path / "p.jsonl"
    result = runner.invoke(
        cli,
        [
            "infer",
            "--model",
            str(trained),
            "--data-dir",
            str(prepared),
            "--predictions-file",
            str(out),
            "--limit",
            "3",
            "--num-beams",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(list(read_jsonl(out))) == 3 and (tmp_path / "metrics.json").is_file()


@pytest.fixture
def tracked_run(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A training's run directory (the model in ``model/``, ``mlflow_run.json``) and its run in a local MLflow
    store (SQLite); yields the directory, the client and the run id."""
    from mlflow import MlflowClient

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    client = MlflowClient(tracking_uri)
    run = client.create_run(client.create_experiment("textsql-infer-test", (tmp_path / "artifacts").as_uri()))
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir / "model")
    (run_dir / MLFLOW_RUN_NAME).write_text(json.dumps({"run_id": run.info.run_id}))
    return run_dir, client, run.info.run_id


def test_textsql_infer_adds_the_scores_to_the_trainings_mlflow_run(tracked_run, prepared):
    """docs/guides/mlflow.md: `textsql infer` adds `<split>_lf_accuracy` and metrics.json to the training's run."""
    run_dir, client, run_id = tracked_run
    result = CliRunner().invoke(
        cli,
        ["infer", "--run-dir", str(run_dir), "--data-dir", str(prepared), "--split", "validation", "--limit", "3"],
    )
    assert result.exit_code == 0, result.output
    assert client.get_run(run_id).data.metrics["validation_lf_accuracy"] == 1.0
    assert [artifact.path for artifact in client.list_artifacts(run_id, "validation")] == ["validation/metrics.json"]


def test_notebook_03s_calls_add_both_sources_scores_to_the_run_apart(tracked_run, prepared):
    """Notebook 03 hands predict() a loaded Predictor, for its questions and then the real ones (real_metrics.json):
    both reach the run, the real ones under their own names."""
    run_dir, client, run_id = tracked_run
    predictor = Predictor.load(run_dir / "model")
    options = GenerationOptions(batch_size=4)
    predict(
        predictor, prepared, "validation", out=run_dir / "predictions.jsonl", options=options, limit=3, progress=False
    )
    real = predict(
        predictor,
        "sample",
        "validation",
        out=run_dir / REAL_PREDICTIONS_NAME,
        options=options,
        limit=2,
        progress=False,
        metrics_out=run_dir / REAL_METRICS_NAME,
    )
    metrics = client.get_run(run_id).data.metrics
    assert metrics["validation_lf_accuracy"] == 1.0 and metrics["validation_n"] == 3
    assert (
        metrics["real_validation_lf_accuracy"] == real["metrics"]["lf_accuracy"] and metrics["real_validation_n"] == 2
    )
    artifacts = [artifact.path for artifact in client.list_artifacts(run_id, "validation")]
    assert artifacts == ["validation/metrics.json", f"validation/{REAL_METRICS_NAME}"]


def test_infer_writes_into_the_run_directory_not_the_current_one(trained, prepared, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "model").symlink_to(trained)
    result = CliRunner().invoke(cli, ["infer", "--run-dir", "run", "--data-dir", str(prepared), "--limit", "2"])
    assert result.exit_code == 0, result.output
    assert {"predictions.jsonl", "metrics.json"} <= {path.name for path in run.iterdir()}
    assert [path.name for path in tmp_path.iterdir()] == ["run"]


def test_cli_mistakes_are_one_line(trained, prepared, tmp_path):
    runner = CliRunner()
    missing_header = runner.invoke(cli, ["infer", "--model", str(trained), "--question", "Who?"])
    assert missing_header.exit_code == 2 and "--header" in missing_header.output
    bad_header = runner.invoke(cli, ["infer", "--model", str(trained), "--question", "Who?", "--header", "[1, 2"])
    assert bad_header.exit_code == 1 and bad_header.output.startswith("Error: --header")
    missing_model = runner.invoke(cli, ["infer", "--run-dir", str(tmp_path / "nope"), "--data-dir", str(prepared)])
    assert missing_model.exit_code == 1 and "--model" in missing_model.output
    bad_device = runner.invoke(
        cli, ["infer", "--model", str(trained), "--device", "gpu0", "--question", "Who?", "--header", "A"]
    )
    assert bad_device.exit_code == 1 and bad_device.output.splitlines()[-1].startswith("Error: unknown device 'gpu0'")


def test_question_sources_and_bad_input(prepared, tmp_path):
    assert len(load_questions(prepared, "test").items) == QUESTIONS
    assert len(load_questions("sample", "validation", limit=5).items) == 5
    with pytest.raises(DataError, match="no 'dev' split"):
        load_questions(prepared, "dev")
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "Who?"}) + "\n")
    with pytest.raises(DataError, match="line 1 needs a question and a header"):
        load_questions(path)
    with pytest.raises(DataError, match="batch_size must be at least 1"):
        GenerationOptions(batch_size=0)


def test_parse_header():
    assert parse_header("Player, No.,Team") == ["Player", "No.", "Team"]
    assert parse_header('["Points, total", "Team"]') == ["Points, total", "Team"]
    with pytest.raises(DataError, match="no column names"):
        parse_header(" , ")


@pytest.mark.parametrize("in_kernel, shown_on", [(True, "out"), (False, "err")])
def test_progress_is_one_stdout_line_in_a_notebook_kernel(monkeypatch, capsys, in_kernel, shown_on):
    """In a kernel the bar goes to stdout, where its carriage returns keep it one updating line (on stderr an
    executed notebook shows every update as a red block); in a terminal it stays on stderr."""
    if in_kernel:
        monkeypatch.setitem(sys.modules, "ipykernel", sys.modules.get("ipykernel") or types.ModuleType("ipykernel"))
    else:
        monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    predictor = Predictor(load_model(None), load_tokenizer(None))
    predictor.generate(
        [predictor.encode("Who is number 3?", ["Player", "No."])], GenerationOptions(max_new_tokens=4), progress=True
    )
    captured = capsys.readouterr()
    assert "Generating" in getattr(captured, shown_on) and "Generating" not in getattr(
        captured, "err" if in_kernel else "out"
    )
