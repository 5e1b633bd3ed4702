"""WikiSQL metrics against the real dev file (logical form) and hand-built tables (execution)."""

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from textsql.cli import cli
from textsql.data.sql import parse_sql, render_sql
from textsql.data.wikisql import load_split
from textsql.errors import DataError
from textsql.files import load_tables, read_jsonl
from textsql.scoring.engine import ExecutionError, TableEngine, to_number
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


# --- execution on hand-built tables --------------------------------------------------------------

PLAYERS = {
    "header": ["Player", "No.", "Position", "Height", "School"],
    "types": ["text", "real", "text", "real", "text"],
    "rows": [
        ["Ann Lee", 3, "Guard", 1.80, "Butler CC (KS)"],
        ["Bob Ray", 12, "Forward", 2.01, "Duke"],
        ["Cy Fox", 3, "Center", 2.10, "Duke"],
        ["Di Hu", "1,000", "Guard", "1.75 m", "UCLA"],
    ],
}


@pytest.fixture
def engine():
    with TableEngine({"players": PLAYERS}) as engine:
        yield engine


def q(sel, agg=0, conds=()):
    return {"sel": sel, "agg": agg, "conds": [list(c) for c in conds]}


@pytest.mark.parametrize(
    "agg, expected",
    [
        (0, [2.01, 2.10]),  # plain select, in table order
        (1, [2.10]),  # MAX
        (2, [2.01]),  # MIN
        (3, [2]),  # COUNT
        (4, [pytest.approx(4.11)]),  # SUM
        (5, [pytest.approx(2.055)]),  # AVG
    ],
)
def test_every_aggregation_runs_in_sql(engine, agg, expected):
    assert engine.execute("players", q(3, agg, [(4, 0, "Duke")])) == expected


@pytest.mark.parametrize("agg, expected", [(0, []), (1, [None]), (3, [0]), (5, [None])])
def test_empty_results(engine, agg, expected):
    assert engine.execute("players", q(3, agg, [(4, 0, "Nowhere")])) == expected


def test_text_is_case_insensitive_and_numbers_are_read_from_text(engine):
    assert engine.execute("players", q(0, 0, [(4, 0, "butler cc (ks)")])) == ["ann lee"]
    assert engine.execute("players", q(0, 0, [(1, 0, "3")])) == ["ann lee", "cy fox"]
    assert engine.execute("players", q(0, 0, [(1, 0, 3.0)])) == ["ann lee", "cy fox"]
    assert engine.execute("players", q(0, 0, [(1, 0, "1000")])) == ["di hu"]  # cell "1,000"
    assert engine.execute("players", q(0, 0, [(1, 1, "no. 100")])) == ["di hu"]  # first number in text
    assert engine.execute("players", q(0, 0, [(3, 2, "1.8")])) == ["di hu"]  # cell "1.75 m"
    assert engine.execute("players", q(0, 0, [(3, 1, "2"), (2, 0, "FORWARD")])) == ["bob ray"]


def test_failing_queries_raise_execution_error(engine):
    for query in (q(9), q(0, 6), q(0, 0, [(1, 3, "3")]), q(0, 0, [(1, 0, "three")]), {"sel": 0}):
        with pytest.raises(ExecutionError):
            engine.execute("players", query)


def test_to_number_reads_release_values():
    assert to_number("1,234.5") == 1234.5
    assert to_number("-3") == -3.0
    assert to_number(".5") == 0.5
    assert to_number("12 km") == 12.0
    with pytest.raises(ValueError):
        to_number("n/a")


def players_gold():
    return [
        {"id": "q0", "table_id": "players", "sql": q(0, 0, [(4, 0, "Butler CC (KS)")])},
        {"id": "q1", "table_id": "players", "sql": q(3, 3, [(4, 0, "Duke")])},
        {"id": "q2", "table_id": "players", "sql": q(1, 4, [(2, 0, "Guard")])},
        {"id": "q3", "table_id": "players", "sql": q(0, 0, [(1, 0, "3"), (2, 0, "Center")])},
        {"id": "q4", "table_id": "players", "sql": q(0, 0, [(2, 0, "Nobody")])},
    ]


def test_execution_accuracy_differs_from_logical_form_where_it_should():
    gold = players_gold()
    pred = [
        {"query": q(0, 0, [(4, 0, "butler cc (ks)")])},  # case only: both right
        {"query": q(0, 3, [(4, 0, "Duke")])},  # COUNT of another column: same result
        {"query": q(1, 4, [(2, 0, "guard")])},  # both right
        {"query": q(0, 0, [(1, 0, 3.0), (2, 0, "center")])},  # 3.0 vs "3": LF wrong, EX right
        {"query": q(9, 0, [(2, 0, "Nobody")])},  # fails to execute: wrong
    ]
    report = evaluate(gold, pred, tables={"players": PLAYERS})
    assert (report["lf_correct"], report["ex_correct"]) == (2, 4)
    assert report["ex_accuracy"] == 0.8
    assert report["errors"] == 1
    assert report["by_aggregation"]["COUNT"] == {
        "n": 1,
        "lf_accuracy": 0.0,
        "ex_accuracy": 1.0,
        "lf_standard_error": 0.0,
        "ex_standard_error": 0.0,
        "lf_correct": 0,
        "ex_correct": 1,
        "errors": 0,
        "parse_rate": 1.0,
    }
    assert report["by_conditions"]["2"]["ex_accuracy"] == 1.0


def test_every_accuracy_comes_with_its_standard_error_in_the_report_and_its_table():
    """Two right of five: 40 %, give or take sqrt(0.4 * 0.6 / 5) = 21.9 points; the table prints it beside each score."""
    gold = players_gold()
    pred = [{"query": item["sql"]} for item in gold[:2]] + [{"error": "no query"}] * (len(gold) - 2)
    report = evaluate(gold, pred, tables={"players": PLAYERS})
    assert len(gold) == 5 and report["lf_accuracy"] == report["ex_accuracy"] == 0.4
    assert round(report["lf_standard_error"], 4) == round(report["ex_standard_error"], 4) == 0.2191
    shown = format_report(report).splitlines()
    assert shown[0].split() == ["n", "LF", "%", "±", "SE", "EX", "%", "±", "SE"]
    assert shown[1].split() == ["all", "5", "40.00", "±", "21.91", "40.00", "±", "21.91"]
    assert evaluate(gold, pred)["ex_standard_error"] is None  # no rows: no execution accuracy, no error either


def test_empty_result_equals_only_empty_result():
    gold = players_gold()[4:]
    assert evaluate(gold, [{"query": q(3, 0, [(2, 0, "Nobody")])}], tables={"players": PLAYERS})["ex_accuracy"] == 1.0
    assert evaluate(gold, [{"query": q(3, 3, [(2, 0, "Nobody")])}], tables={"players": PLAYERS})["ex_accuracy"] == 0.0


def test_tables_come_from_a_file_or_from_records_and_rowless_tables_give_null(tmp_path: Path):
    tables = tmp_path / "dev.tables.jsonl"
    tables.write_text(json.dumps({"id": "players", **PLAYERS}) + "\n")
    gold = players_gold()
    pred = [{"query": item["sql"]} for item in gold]
    assert load_tables(tables)["players"]["rows"] == PLAYERS["rows"]
    assert evaluate(gold, pred, tables=tables)["ex_accuracy"] == 1.0
    records = [dict(item, **PLAYERS) for item in gold]
    assert evaluate(records, pred)["ex_accuracy"] == 1.0
    headers_only = [{**item, **PLAYERS, "rows": []} for item in gold]
    assert evaluate(headers_only, pred)["ex_accuracy"] is None
    with pytest.raises(DataError, match="no table 'elsewhere'"):
        evaluate([dict(gold[0], table_id="elsewhere")], pred[:1], tables=tables)


# --- command line ------------------------------------------------------------------------------


def test_cli_finds_tables_beside_gold_and_writes_json(tmp_path: Path):
    gold_path, pred_path = tmp_path / "dev.jsonl", tmp_path / "pred.jsonl"
    gold = players_gold()
    gold_path.write_text("".join(json.dumps({k: v for k, v in item.items() if k != "id"}) + "\n" for item in gold))
    (tmp_path / "dev.tables.jsonl").write_text(json.dumps({"id": "players", **PLAYERS}) + "\n")
    pred = [{"query": item["sql"]} for item in gold]
    pred[1] = {"error": "bad"}
    pred_path.write_text("".join(json.dumps(item) + "\n" for item in pred))
    out = tmp_path / "metrics.json"
    result = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--gold",
            str(gold_path),
            "--predictions-file",
            str(pred_path),
            "--json",
            "--report-file",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ex_accuracy"] == 0.8
    assert json.loads(out.read_text())["lf_accuracy"] == 0.8
    table = CliRunner().invoke(cli, ["evaluate", "--gold", str(gold_path), "--predictions-file", str(pred_path)])
    assert "all" in table.output and "80.00" in table.output


def test_cli_mismatched_lengths_is_one_line_error(tmp_path: Path):
    gold_path, pred_path = tmp_path / "dev.jsonl", tmp_path / "pred.jsonl"
    gold_path.write_text(json.dumps(players_gold()[0]) + "\n")
    pred_path.write_text("")
    result = CliRunner().invoke(cli, ["evaluate", "--gold", str(gold_path), "--predictions-file", str(pred_path)])
    assert result.exit_code == 1
    assert result.output.strip().startswith("Error: ") and len(result.output.strip().splitlines()) == 1


def test_cli_scores_our_predictions_alone_from_their_gold_queries(tmp_path: Path):
    pred_path = tmp_path / "predictions.jsonl"
    lines = [
        {"id": item["id"], "table_id": "players", "query": item["sql"], "error": None, "gold_query": item["sql"]}
        for item in players_gold()
    ]
    lines[0]["query"] = q(1)
    pred_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli, ["evaluate", "--predictions-file", str(pred_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["lf_correct"] == 4
    official = tmp_path / "official.jsonl"
    official.write_text(json.dumps({"query": q(1)}) + "\n")
    refused = CliRunner().invoke(cli, ["evaluate", "--predictions-file", str(official)])
    assert refused.exit_code == 1 and "pass --gold" in refused.output


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_target_text_read_back_scores_one_on_the_sample(split):
    """The model's target text (textsql.data.sql) loses nothing the official comparison looks at."""
    records, tables = load_split("sample", split)
    pred = [{"id": r["id"], "query": parse_sql(render_sql(r["sql"], r["header"]), r["header"])} for r in records]
    report = evaluate(records, pred, tables=tables, ordered=True)
    assert report["n"] == len(records) and report["lf_accuracy"] == 1.0


def test_cli_invalid_utf8_in_gold_is_one_line_naming_file_and_line(tmp_path: Path):
    gold_path, pred_path = tmp_path / "dev.jsonl", tmp_path / "pred.jsonl"
    gold = players_gold()
    lines = [json.dumps({k: v for k, v in item.items() if k != "id"}).encode() for item in gold]
    lines[2] = lines[2].replace(b'"table_id": "', b'"table_id": "\xc3\x28', 1)
    gold_path.write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "dev.tables.jsonl").write_text(json.dumps({"id": "players", **PLAYERS}) + "\n")
    pred_path.write_text("".join(json.dumps({"query": item["sql"]}) + "\n" for item in gold))
    result = CliRunner().invoke(cli, ["evaluate", "--gold", str(gold_path), "--predictions-file", str(pred_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.count("\n") == 1 and f"{gold_path}:3: not UTF-8" in result.output, result.output
