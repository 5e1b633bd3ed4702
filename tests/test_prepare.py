"""textsql prepare: the tokenized DatasetDict on disk, its summary, the collator's batches, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from datasets import load_from_disk
from transformers import DataCollatorForSeq2Seq

from textsql.cli import cli
from textsql.constants import LABEL_PAD_TOKEN_ID, SPLITS
from textsql.data.prepare import PrepareArguments, prepare
from textsql.data.wikisql import load_split, recorded_input_format
from textsql.errors import DataError
from textsql.model import load_tokenizer

COLUMNS = [
    "id",
    "table_id",
    "question",
    "header",
    "sql",
    "target",
    "source_text",
    "input_ids",
    "attention_mask",
    "labels",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepare") / "data"
    return prepare(data_dir=str(out))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_the_full_sample_is_saved_in_the_contract_form(prepared, tokenizer):
    data = load_from_disk(prepared["data_dir"])
    assert list(data) == list(SPLITS)
    assert {split: data[split].column_names for split in SPLITS} == {split: COLUMNS for split in SPLITS}
    assert (
        {split: len(data[split]) for split in SPLITS}
        == prepared["counts"]
        == {"train": 1000, "validation": 100, "test": 100}
    )
    row = data["validation"][1]
    assert row["target"] == "SELECT COUNT School/Club Team FROM table WHERE No. = 3"
    assert json.loads(row["sql"]) == {"sel": 5, "agg": 3, "conds": [[1, 0, "3"]]}
    assert row["source_text"].endswith(
        "columns: Player | No. | Nationality | Position | Years in Toronto | School/Club Team"
    )
    assert tokenizer.decode(row["labels"], skip_special_tokens=True) == row["target"]
    for split in SPLITS:
        for row in data[split]:
            # unpadded: every position is real, and both sequences end with </s>
            assert row["attention_mask"] == [1] * len(row["input_ids"])
            assert row["input_ids"][-1] == row["labels"][-1] == tokenizer.eos_token_id
            assert tokenizer.pad_token_id not in row["input_ids"] + row["labels"]


def test_prepare_json_and_tables_describe_the_output(prepared, tokenizer):
    prepared_dir = Path(prepared["data_dir"])
    summary = json.loads((prepared_dir / "prepare.json").read_text())
    assert summary["source"] == "sample" and summary["tokenizer"] == "default" and summary["input_format"] == "schema"
    assert summary["counts"] == prepared["counts"]
    assert summary["truncated"] == {split: {"source": 0, "target": 0} for split in SPLITS}
    data = load_from_disk(prepared["data_dir"])
    assert summary["targets_with_unknown_tokens"] == {
        split: sum(tokenizer.unk_token_id in row["labels"] for row in data[split]) for split in SPLITS
    }
    assert summary["targets_with_unknown_tokens"]["train"] > 0  # e.g. "Svāhā": T5's vocabulary lacks some letters
    for split in SPLITS:
        lengths = summary["source_length"][split]
        assert 0 < lengths["p50"] <= lengths["p90"] <= lengths["p95"] <= lengths["p99"] <= lengths["max"] <= 512
        tables = [
            json.loads(line) for line in (prepared_dir / "tables" / f"{split}.tables.jsonl").read_text().splitlines()
        ]
        assert {table["id"] for table in tables} == set(load_split("sample", split)[1])
        assert set(tables[0]) >= {"id", "header", "types", "rows"}
    assert not [path for path in prepared_dir.parent.iterdir() if path.name.startswith(".")]  # no staging left


def test_truncation_is_counted_and_matches_the_tokenizer(tmp_path, tokenizer):
    summary = prepare(data_dir=str(tmp_path / "short"), limit=30, max_source_length=24, max_target_length=12)
    data = load_from_disk(summary["data_dir"])
    for split in SPLITS:
        rows = data[split].to_dict()
        sources = tokenizer(rows["source_text"])["input_ids"]
        targets = tokenizer(text_target=rows["target"])["input_ids"]
        assert summary["truncated"][split] == {
            "source": sum(len(ids) > 24 for ids in sources),
            "target": sum(len(ids) > 12 for ids in targets),
        }
        assert summary["truncated"][split]["source"] > 0 and summary["truncated"][split]["target"] > 0
        assert rows["input_ids"] == tokenizer(rows["source_text"], truncation=True, max_length=24)["input_ids"]
        assert rows["labels"] == tokenizer(text_target=rows["target"], truncation=True, max_length=12)["input_ids"]


def test_collator_pads_masks_and_labels(prepared, tokenizer):
    rows = load_from_disk(prepared["data_dir"])["train"].select(range(8)).remove_columns(COLUMNS[:7])
    features = [rows[index] for index in range(len(rows))]
    batch = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=LABEL_PAD_TOKEN_ID, return_tensors="pt")(features)
    assert len({len(f["input_ids"]) for f in features}) > 1 and len({len(f["labels"]) for f in features}) > 1
    for index, feature in enumerate(features):
        length, target_length = len(feature["input_ids"]), len(feature["labels"])
        assert batch["input_ids"][index, :length].tolist() == feature["input_ids"]
        assert batch["attention_mask"][index].tolist() == [1] * length + [0] * (batch["input_ids"].shape[1] - length)
        assert set(batch["input_ids"][index, length:].tolist()) <= {tokenizer.pad_token_id}
        assert batch["labels"][index].tolist() == feature["labels"] + [LABEL_PAD_TOKEN_ID] * (
            batch["labels"].shape[1] - target_length
        )
    assert int((batch["labels"] == LABEL_PAD_TOKEN_ID).sum()) == sum(
        batch["labels"].shape[1] - len(f["labels"]) for f in features
    )
    assert batch["labels"].dtype == torch.long


def test_num_proc_and_input_format(tmp_path):
    one = load_from_disk(prepare(data_dir=str(tmp_path / "one"), limit=40, input_format="question")["data_dir"])
    two = load_from_disk(
        prepare(data_dir=str(tmp_path / "two"), limit=40, input_format="question", num_proc=2)["data_dir"]
    )
    for split in SPLITS:
        assert one[split].to_list() == two[split].to_list()
    assert one["train"][0]["source_text"] == "translate to SQL: Tell me what the notes are for South Australia"


def test_the_uncased_format_lowers_input_and_target_and_is_recorded(tmp_path):
    out = prepare(data_dir=str(tmp_path / "data"), limit=5, input_format="uncased")["data_dir"]
    row = load_from_disk(out)["train"][0]
    body = row["source_text"].removeprefix("translate to SQL: ")
    assert body == body.lower() and row["header"][0].lower() in body and body != row["source_text"]
    assert row["target"] == row["target"].lower() and row["target"].startswith("select ")
    assert recorded_input_format(out) == "uncased" and recorded_input_format(tmp_path) == "schema"


def test_overwrite_replaces_and_refuses_without_the_flag(tmp_path):
    out = tmp_path / "data"
    prepare(data_dir=str(out), limit=3)
    with pytest.raises(DataError, match="already exists; pass --overwrite \\(notebook: overwrite=True\\)"):
        prepare(data_dir=str(out), limit=4)
    prepare(data_dir=str(out), limit=4, overwrite=True)
    assert json.loads((out / "prepare.json").read_text())["counts"]["train"] == 4
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_proc": 0}, "--num-proc"),
        ({"max_source_length": 1}, "--max-source-length"),
        ({"input_format": "sql"}, "--input-format"),
        ({"limit": 0}, "--limit"),
    ],
)
def test_arguments_are_checked_up_front(tmp_path, options, message):
    with pytest.raises(DataError, match=message):
        PrepareArguments(data_dir=str(tmp_path / "x"), **options)


def _insert_line(release, stem, line):
    path = release / f"{stem}.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(1, line)
    path.write_text("\n".join(lines) + "\n")


def malformed_line(release, tmp_path):
    _insert_line(release, "test", "{not json")
    return ["--source", str(release)]


def missing_table(release, tmp_path):
    _insert_line(
        release, "dev", json.dumps({"table_id": "1-0-0", "question": "Who?", "sql": {"sel": 0, "agg": 0, "conds": []}})
    )
    return ["--source", str(release)]


def invalid_utf8(release, tmp_path):
    path = release / "dev.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1].replace(b'"question": "', b'"question": "\xff\xfe', 1) + b"".join(lines[2:]))
    return ["--source", str(release)]


def _sel_as(value):
    def setup(release, tmp_path):
        first = json.loads((release / "dev.jsonl").read_text().splitlines()[0])
        first["sql"]["sel"] = value
        _insert_line(release, "dev", json.dumps(first))
        return ["--source", str(release)]

    return setup


def unknown_source(release, tmp_path):
    return ["--source", "wikisql"]


def broken_tokenizer(release, tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("garbage")
    (tmp_path / "tok" / "config.json").write_text('{"model_type": "t5"}')
    return ["--tokenizer", str(tmp_path / "tok")]


def no_tokenizer(release, tmp_path):
    (tmp_path / "empty").mkdir()
    return ["--tokenizer", str(tmp_path / "empty")]


@pytest.mark.parametrize(
    "setup, expected",
    [
        (malformed_line, "test.jsonl:2: not a JSON object"),
        (missing_table, "dev.jsonl:2: table '1-0-0' is not in"),
        (invalid_utf8, "dev.jsonl:2: not UTF-8"),
        (_sel_as("3"), "dev.jsonl:2: sql must be"),
        (_sel_as(True), "dev.jsonl:2: sql must be"),
        (unknown_source, "unknown source 'wikisql'"),
        (broken_tokenizer, "cannot load a tokenizer"),
        (no_tokenizer, "no tokenizer in"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, wikisql_release_copy, setup, expected):
    arguments = setup(wikisql_release_copy, tmp_path)
    result = CliRunner().invoke(cli, ["prepare", "--data-dir", str(tmp_path / "out"), "--limit", "5", *arguments])
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: ") and expected in result.stderr
    assert isinstance(result.exception, SystemExit)  # click's exit, not an escaped exception
    assert not (tmp_path / "out").exists()
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".out")]


def test_cli_writes_and_summarises(tmp_path):
    result = CliRunner().invoke(
        cli, ["prepare", "--data-dir", str(tmp_path / "out"), "--limit", "5", "--input-format", "question"]
    )
    assert result.exit_code == 0, result.output
    assert "train: 5 questions" in result.stdout
    assert json.loads((tmp_path / "out" / "prepare.json").read_text())["input_format"] == "question"


@pytest.mark.slow  # a fresh Python that loads datasets (offline is read at import)
def test_hub_source_reaches_the_network_edge_with_a_clear_error(tmp_path):
    """The real hub path, run offline: datasets refuses at the hub, and the command says what to do."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}
    completed = subprocess.run(
        [
            str(Path(sys.executable).parent / "textsql"),
            "prepare",
            "--source",
            "hub",
            "--data-dir",
            str(tmp_path / "out"),
        ],
        check=False,
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert completed.returncode == 1
    assert completed.stderr.count("\n") == 1, completed.stderr
    assert completed.stderr.startswith(
        "Error: cannot load 'Salesforce/wikisql' at revision 'refs/convert/parquet' from the hub"
    )
    assert "pass --source sample" in completed.stderr
    assert not (tmp_path / "out").exists()
