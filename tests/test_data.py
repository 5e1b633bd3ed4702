"""WikiSQL sources (shipped sample, release directory, hub parquet) normalised to records."""

import json
import sys

import datasets
import pytest

from textsql.constants import PROJECT_DIR, SAMPLE_DATA_DIR, SPLITS
from textsql.data.wikisql import load_records, load_split, records_from_hub, source_text, target_text
from textsql.errors import DataError

RECORD_KEYS = {"id", "table_id", "question", "header", "types", "rows", "sql"}
# The hub's parquet conversion of Salesforce/wikisql keeps the features of its loading script.
HUB_FEATURES = datasets.Features(
    {
        "phase": datasets.Value("int32"),
        "question": datasets.Value("string"),
        "table": {
            "header": datasets.Sequence(datasets.Value("string")),
            "page_title": datasets.Value("string"),
            "page_id": datasets.Value("string"),
            "types": datasets.Sequence(datasets.Value("string")),
            "id": datasets.Value("string"),
            "section_title": datasets.Value("string"),
            "caption": datasets.Value("string"),
            "rows": datasets.Sequence(datasets.Sequence(datasets.Value("string"))),
            "name": datasets.Value("string"),
        },
        "sql": {
            "human_readable": datasets.Value("string"),
            "sel": datasets.Value("int32"),
            "agg": datasets.Value("int32"),
            "conds": datasets.Sequence(
                {
                    "column_index": datasets.Value("int32"),
                    "operator_index": datasets.Value("int32"),
                    "condition": datasets.Value("string"),
                }
            ),
        },
    }
)
HUB_TABLE = {
    "header": ["Player", "No.", "Nationality", "Position", "Years in Toronto", "School/Club Team"],
    "page_title": "Toronto Raptors all-time roster",
    "page_id": "",
    "types": ["text"] * 6,
    "id": "1-10015132-11",
    "section_title": "L",
    "caption": "L",
    "name": "table_10015132_11",
    "rows": [["Antonio Lang", "21", "United States", "Guard-Forward", "1999-2000", "Duke"]],
}
HUB_ROWS = [
    {
        "phase": 1,
        "question": "What position does the player who played for butler cc (ks) play?",
        "table": HUB_TABLE,
        "sql": {
            "human_readable": "SELECT Position FROM table WHERE School/Club Team = Butler CC (KS)",
            "sel": 3,
            "agg": 0,
            "conds": {"column_index": [5], "operator_index": [0], "condition": ["Butler CC (KS)"]},
        },
    },
    {
        "phase": 1,
        "question": "How many players wore a number under 10?",
        "table": HUB_TABLE,
        "sql": {
            "human_readable": "SELECT COUNT Player FROM table WHERE No. < 10 AND Nationality = United States",
            "sel": 0,
            "agg": 3,
            "conds": {"column_index": [1, 2], "operator_index": [2, 0], "condition": ["10", "United States"]},
        },
    },
    {
        "phase": 1,
        "question": "Who are the players?",
        "table": HUB_TABLE,
        "sql": {
            "human_readable": "SELECT Player FROM table",
            "sel": 0,
            "agg": 0,
            "conds": {"column_index": [], "operator_index": [], "condition": []},
        },
    },
]


def test_sample_has_the_documented_counts_and_every_question_has_its_table():
    counts = {}
    for split in SPLITS:
        records, tables = load_split("sample", split)
        counts[split] = len(records)
        assert {record["table_id"] for record in records} == set(tables)
        for record in records:
            assert record.keys() == RECORD_KEYS
            assert record["header"] == tables[record["table_id"]]["header"]
            assert len(record["types"]) == len(record["header"]) and set(record["types"]) <= {"text", "real"}
            assert record["rows"] == []
            target_text(record)  # every query renders over its header
    assert counts == {"train": 1000, "validation": 100, "test": 100}
    assert load_records("sample", "validation")[0]["id"] == "validation-0"


def test_sample_dev_and_test_are_the_release_lines(shared_data_dir):
    for split, stem in (("validation", "dev"), ("test", "test")):
        with open(shared_data_dir / "wikisql" / "original" / f"{stem}.jsonl") as lines:
            release = [json.loads(next(lines)) for _ in range(100)]
        records = load_records("sample", split)
        assert [(r["table_id"], r["question"], r["sql"]) for r in records] == [
            (q["table_id"], q["question"], q["sql"]) for q in release
        ]


def test_sample_regenerates_byte_for_byte(shared_data_dir, tmp_path):
    sys.path.insert(0, str(PROJECT_DIR / "scripts"))
    try:
        import build_sample
    finally:
        sys.path.pop(0)
    counts = build_sample.build(shared_data_dir / "wikisql", tmp_path / "sample")
    assert counts == {"train": 1000, "dev": 100, "test": 100}
    shipped = sorted(path.name for path in SAMPLE_DATA_DIR.iterdir())
    assert sorted(path.name for path in (tmp_path / "sample").iterdir()) == shipped
    for name in shipped:
        assert (tmp_path / "sample" / name).read_bytes() == (SAMPLE_DATA_DIR / name).read_bytes(), name


def test_sample_keeps_headers_whose_names_hold_commas():
    headers = [table["header"] for table in load_split("sample", "validation")[1].values()]
    assert any("Prevailing types, %" in header for header in headers)


def test_a_release_directory_loads_with_a_limit(wikisql_release_copy):
    records, tables = load_split(wikisql_release_copy, "train", limit=5)
    assert [record["id"] for record in records] == [f"train-{index}" for index in range(5)]
    assert set(tables) == {record["table_id"] for record in records}
    assert records == load_records("sample", "train")[:5]


@pytest.mark.parametrize(
    "corruption, message",
    [
        (
            lambda lines: lines.insert(3, '{"table_id": "1-10015132-11", "question": "x",'),
            "dev.jsonl:4: not a JSON object",
        ),
        (
            lambda lines: lines.insert(
                2, json.dumps({"table_id": "1-999-1", "question": "Who?", "sql": {"sel": 0, "agg": 0, "conds": []}})
            ),
            "dev.jsonl:3: table '1-999-1' is not in",
        ),
        (
            lambda lines: lines.insert(
                0,
                json.dumps({"table_id": "1-10015132-11", "question": "Who?", "sql": {"sel": 9, "agg": 0, "conds": []}}),
            ),
            "dev.jsonl:1: sql refers to a column outside",
        ),
        (
            lambda lines: lines.insert(0, json.dumps({"table_id": "1-10015132-11", "question": "Who?"})),
            "dev.jsonl:1: a question needs",
        ),
    ],
)
def test_bad_lines_name_file_line_and_fix(wikisql_release_copy, corruption, message):
    path = wikisql_release_copy / "dev.jsonl"
    lines = path.read_text().splitlines()
    corruption(lines)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="fix|add the table") as error:
        load_records(wikisql_release_copy, "validation")
    assert message in str(error.value)


def test_unknown_sources_and_missing_files_say_what_to_pass(tmp_path, wikisql_release_copy):
    with pytest.raises(DataError, match="unknown source 'hubb'.*pass --source sample"):
        load_records("hubb", "train")
    (wikisql_release_copy / "test.tables.jsonl").unlink()
    with pytest.raises(DataError, match="test.tables.jsonl' is missing"):
        load_records(wikisql_release_copy, "test")
    with pytest.raises(DataError, match="unknown split 'dev'"):
        load_records("sample", "dev")


def _hub_parquet(tmp_path):
    """A parquet file in the hub's schema, read back the way load_dataset reads the hub's files."""
    path = tmp_path / "validation-00000-of-00001.parquet"
    datasets.Dataset.from_list(HUB_ROWS, features=HUB_FEATURES).to_parquet(str(path))
    return datasets.load_dataset(
        "parquet", data_files={"validation": str(path)}, split="validation", cache_dir=str(tmp_path / "cache")
    )


def test_hub_rows_convert_to_records_and_release_tables(tmp_path):
    rows = _hub_parquet(tmp_path)
    assert isinstance(rows[1]["sql"]["conds"], dict)  # the hub schema's dict of lists
    records, tables = records_from_hub(rows, "validation")
    assert [record["sql"] for record in records] == [
        {"sel": 3, "agg": 0, "conds": [[5, 0, "Butler CC (KS)"]]},
        {"sel": 0, "agg": 3, "conds": [[1, 2, "10"], [2, 0, "United States"]]},
        {"sel": 0, "agg": 0, "conds": []},
    ]
    assert [record["id"] for record in records] == ["validation-0", "validation-1", "validation-2"]
    assert tables["1-10015132-11"]["rows"] == HUB_TABLE["rows"]
    assert tables["1-10015132-11"]["header"] == HUB_TABLE["header"] == records[0]["header"]
    # the hub's own rendering agrees with ours, but for how "<" is spelled
    assert [target_text(record) for record in records] == [
        row["sql"]["human_readable"].replace(" < ", " LT ") for row in HUB_ROWS
    ]
    assert records_from_hub(
        [
            {
                **HUB_ROWS[1],
                "sql": {**HUB_ROWS[1]["sql"], "conds": [{"column_index": 1, "operator_index": 2, "condition": "10"}]},
            }
        ],
        "train",
    )[0][0]["sql"]["conds"] == [[1, 2, "10"]]


def test_hub_source_asks_for_the_parquet_revision(tmp_path, monkeypatch):
    rows = _hub_parquet(tmp_path)
    calls = []

    def load_dataset(path, **options):
        calls.append((path, options))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    records, _ = load_split("hub", "validation", limit=2)
    assert calls == [("Salesforce/wikisql", {"revision": "refs/convert/parquet", "split": "validation"})]
    assert len(records) == 2


def test_input_formats():
    header = ["No.", "School/Club Team"]
    assert (
        source_text("How many  schools? ", header)
        == "translate to SQL: How many schools? columns: No. | School/Club Team"
    )
    assert source_text("How many schools?", header, "question") == "translate to SQL: How many schools?"
    assert (
        source_text("How many Schools?", header, "uncased")
        == "translate to SQL: how many schools? columns: no. | school/club team"
    )
    with pytest.raises(DataError, match="--input-format schema or question or uncased"):
        source_text("x", header, "sql")
