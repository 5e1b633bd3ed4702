"""WikiSQL's logical-form metric against the real dev file, and the target text read back on the sample. Execution
accuracy on hand-built tables and `textsql evaluate`: test_evaluate_execution.py."""

import copy
from collections import Counter
from pathlib import Path

import pytest

from textsql.data.sql import parse_sql, render_sql
from textsql.data.wikisql import load_split
from textsql.errors import DataError
from textsql.json_files import read_jsonl
from textsql.scoring.evaluate import evaluate, format_report


@pytest.fixture(scope="module")
def dev(shared_data_dir: Path) -> list[dict]:
    return list(read_jsonl(shared_data_dir / "wikisql" / "original" / "dev.jsonl"))


def official(gold: list[dict]) -> list[dict]:
    """Predictions in the official format that repeat the gold queries."""
    return [{"query": copy.deepcopy(item["sql"])} for item in gold]


# --- logical form on the real dev file -------------------------------------------------------


def test_gold_as_prediction_scores_one_with_breakdowns(dev):
    report = evaluate(dev, official(dev))
    assert report["n"] == len(dev) == 8421
    assert report["lf_accuracy"] == 1.0
    assert report["ex_accuracy"] is None  # question files carry no table rows
    aggs = Counter(item["sql"]["agg"] for item in dev)
    assert {name: row["n"] for name, row in report["by_aggregation"].items()} == {
        "none": aggs[0],
        "MAX": aggs[1],
        "MIN": aggs[2],
        "COUNT": aggs[3],
        "SUM": aggs[4],
        "AVG": aggs[5],
    }
    assert list(report["by_aggregation"]) == ["none", "MAX", "MIN", "COUNT", "SUM", "AVG"]
    conds = Counter(len(item["sql"]["conds"]) for item in dev)
    assert {int(name): row["n"] for name, row in report["by_conditions"].items()} == dict(conds)


@pytest.mark.parametrize("k", [1, 17, 842])
def test_changed_select_on_k_lines_is_exactly_k_wrong(dev, k):
    pred = official(dev)
    for item in pred[:: len(dev) // k][:k]:
        item["query"]["sel"] += 1
    report = evaluate(dev, pred)
    assert report["lf_correct"] == len(dev) - k
    assert report["lf_accuracy"] == (len(dev) - k) / len(dev)
    assert report["components"] == {"sel": (len(dev) - k) / len(dev), "agg": 1.0, "where": 1.0}


def test_changed_aggregation_breakdown_points_at_it(dev):
    pred = official(dev)
    for item in pred:
        if item["query"]["agg"] == 3:
            item["query"]["agg"] = 0
    report = evaluate(dev, pred)
    assert report["by_aggregation"]["COUNT"]["lf_accuracy"] == 0.0
    assert report["by_aggregation"]["none"]["lf_accuracy"] == 1.0
    counts = sum(item["sql"]["agg"] == 3 for item in dev)
    assert report["components"] == {"sel": 1.0, "agg": (len(dev) - counts) / len(dev), "where": 1.0}
    assert "parts right    sel 100.00%" in format_report(report)


def test_condition_order_counts_only_when_ordered(dev):
    pred = official(dev)
    for item in pred:
        item["query"]["conds"].reverse()
    reordered = sum(item["sql"]["conds"] != item["sql"]["conds"][::-1] for item in dev)
    assert reordered > 2000
    assert evaluate(dev, pred)["lf_accuracy"] == 1.0
    assert evaluate(dev, pred, ordered=True)["lf_correct"] == len(dev) - reordered
    assert evaluate(dev, official(dev), ordered=True)["lf_accuracy"] == 1.0


def test_value_case_is_ignored_but_value_text_is_not(dev):
    pred = official(dev)
    for item in pred:
        item["query"]["conds"] = [[c, o, v.upper() if isinstance(v, str) else v] for c, o, v in item["query"]["conds"]]
    # str.lower() is not the inverse of str.upper() everywhere ("ı".upper() is "I"): one dev value.
    unicode_trap = sum(
        any(isinstance(v, str) and v.upper().lower() != v.lower() for _, _, v in item["sql"]["conds"]) for item in dev
    )
    assert unicode_trap == 1
    assert evaluate(dev, pred)["lf_correct"] == len(dev) - unicode_trap
    changed = official(dev)
    for item in changed:
        item["query"]["conds"] = [[c, o, f"{v}x"] for c, o, v in item["query"]["conds"]]
    with_conds = sum(bool(item["sql"]["conds"]) for item in dev)
    assert evaluate(dev, changed)["lf_correct"] == len(dev) - with_conds


def test_numbers_compare_as_their_text_like_the_official_script(dev):
    """Gold 2003 matches "2003"; gold 1939.0 matches "1939.0" but not "1939" (str(value))."""
    pred = official(dev)
    for item in pred:
        item["query"]["conds"] = [
            [c, o, str(int(v)) if isinstance(v, (int, float)) else v] for c, o, v in item["query"]["conds"]
        ]
    floats = sum(
        any(isinstance(v, float) and str(int(v)) != str(v) for _, _, v in item["sql"]["conds"]) for item in dev
    )
    ints = sum(any(isinstance(v, int) for _, _, v in item["sql"]["conds"]) for item in dev)
    assert floats > 100 and ints > 1000
    assert evaluate(dev, pred)["lf_correct"] == len(dev) - floats
    as_text = official(dev)
    for item in as_text:
        item["query"]["conds"] = [[c, o, str(v)] for c, o, v in item["query"]["conds"]]
    assert evaluate(dev, as_text)["lf_accuracy"] == 1.0


def test_error_and_malformed_lines_are_wrong_not_fatal(dev):
    pred = official(dev)
    pred[0] = {"error": "could not parse"}
    pred[1] = {"query": {"sel": 1}}
    pred[2] = {"query": {"sel": 1, "agg": 0, "conds": [[1, 0]]}}
    pred[3] = {}
    report = evaluate(dev, pred)
    assert report["lf_correct"] == len(dev) - 4
    assert report["errors"] == 4


def test_parse_rate_counts_queries_whose_columns_belong_to_their_table():
    records, _tables = load_split("sample", "validation")
    pred = [{"id": item["id"], "query": copy.deepcopy(item["sql"])} for item in records]
    pred[0] = {"id": records[0]["id"], "error": "could not parse"}
    pred[1]["query"]["sel"] = len(records[1]["header"])  # one column past the table
    pred[2]["query"]["conds"] = [[len(records[2]["header"]) + 3, 0, "x"]]  # a condition on no column
    report = evaluate(records, pred)
    assert report["parse_rate"] == (len(records) - 3) / len(records)
    assert report["lf_correct"] == len(records) - 3
    assert "parsed" in format_report(report)


def test_the_trivial_baseline_is_scored_on_the_same_questions():
    records, _ = load_split("sample", "validation")
    common = Counter(item["sql"]["agg"] for item in records).most_common(1)[0][0]
    report = evaluate(records, [{"id": item["id"], "query": copy.deepcopy(item["sql"])} for item in records])
    baseline = report["baseline"]
    assert baseline["query"] == {"sel": 0, "agg": common, "conds": []}
    assert baseline["components"] == {
        "sel": sum(item["sql"]["sel"] == 0 for item in records) / len(records),
        "agg": sum(item["sql"]["agg"] == common for item in records) / len(records),
        "where": sum(not item["sql"]["conds"] for item in records) / len(records),
    }
    assert baseline["parse_rate"] == 1.0 and report["components"] == {"sel": 1.0, "agg": 1.0, "where": 1.0}
    assert "baseline" in format_report(report)


def test_official_predictions_need_one_line_per_gold_line(dev):
    with pytest.raises(DataError, match="8421 gold lines but 8420 predictions"):
        evaluate(dev, official(dev)[:-1])


def test_our_predictions_match_by_id_in_any_order(dev):
    gold = [dict(item, id=f"validation-{i}") for i, item in enumerate(dev[:300])]
    pred = [{"id": item["id"], "query": item["sql"], "error": None} for item in gold]
    pred[5] = {"id": gold[5]["id"], "query": None, "error": "unknown column 'Foo'"}
    pred.reverse()
    report = evaluate(gold, pred)
    assert report["n"] == 300 and report["lf_correct"] == 299
    with pytest.raises(DataError, match="1 gold questions have no prediction"):
        evaluate(gold, pred[1:])


def test_bad_gold_file_is_one_clear_error(tmp_path: Path):
    path = tmp_path / "gold.jsonl"
    path.write_text('{"table_id": "t", "sql": {"sel": 0, "agg": 0, "conds": []}}\nnot json\n')
    with pytest.raises(DataError, match="gold.jsonl:2: not a JSON object"):
        evaluate(path, [])
    with pytest.raises(DataError, match="no table_id and sql"):
        evaluate([{"question": "?"}], [{"query": {"sel": 0, "agg": 0, "conds": []}}])


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_target_text_read_back_scores_one_on_the_sample(split):
    """The model's target text (textsql.data.sql) loses nothing the official comparison looks at."""
    records, tables = load_split("sample", split)
    pred = [{"id": r["id"], "query": parse_sql(render_sql(r["sql"], r["header"]), r["header"])} for r in records]
    report = evaluate(records, pred, tables=tables, ordered=True)
    assert report["n"] == len(records) and report["lf_accuracy"] == 1.0
