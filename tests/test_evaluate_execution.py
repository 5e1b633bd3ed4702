"""WikiSQL's execution metric on hand-built tables (its engine, and where it parts from logical form), and the
`textsql evaluate` command on them. Logical form on the real dev file: test_evaluate.py."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from textsql.cli import cli
from textsql.data.tables import load_tables
from textsql.errors import DataError
from textsql.scoring.engine import ExecutionError, TableEngine, to_number
from textsql.scoring.evaluate import evaluate, format_report

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
