"""The SQL text form: rendering, header-aware parsing, and the round trip over real WikiSQL."""

import json

import pytest

from textsql.constants import COND_OP_TEXT, SPLITS
from textsql.data.sql import canonical_sql, parse_sql, render_sql
from textsql.data.wikisql import load_split
from textsql.errors import SQLParseError
from textsql.model import load_tokenizer

HEADER = ["Player", "No.", "Nationality", "Position", "Years in Toronto", "School/Club Team"]


def test_render_matches_the_documented_form():
    sql = {"sel": 5, "agg": 3, "conds": [[1, 0, "3"]]}
    assert render_sql(sql, HEADER) == "SELECT COUNT School/Club Team FROM table WHERE No. = 3"
    sql = {"sel": 0, "agg": 0, "conds": [[1, 1, 3], [1, 2, 10.5], [3, 0, "Guard"]]}
    assert render_sql(sql, HEADER) == "SELECT Player FROM table WHERE No. > 3 AND No. LT 10.5 AND Position = Guard"


def test_every_operator_spelling_survives_the_t5_vocabulary():
    tokenizer = load_tokenizer()
    assert tokenizer.unk_token_id in tokenizer("No. < 3").input_ids, "the vocabulary gained '<': revisit COND_OP_TEXT"
    for spelling in COND_OP_TEXT:
        text = f"SELECT Player FROM table WHERE No. {spelling} 3"
        ids = tokenizer(text).input_ids
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize(
    "header, sql",
    [
        # a value holding " AND ", an operator and another column's name
        (["Team", "Score"], {"sel": 0, "agg": 0, "conds": [[1, 0, "Tom AND Jerry = 3 AND Team"], [0, 2, "7"]]}),
        # a column name holding an operator and a keyword, beside its own prefix
        (["Points", "Points > 3 AND Team", "Team"], {"sel": 1, "agg": 4, "conds": [[0, 1, "2"], [2, 0, "x"]]}),
        # column names that start like aggregations, and one that is a prefix of another
        (["MAX", "Rank", "Rank (2010)"], {"sel": 0, "agg": 1, "conds": [[2, 0, "1"]]}),
        (["Year", "Notes FROM table WHERE"], {"sel": 1, "agg": 0, "conds": [[0, 2, "1990"]]}),
        # an empty value at the end, and a value that ends in a space
        (["A", "B"], {"sel": 0, "agg": 0, "conds": [[1, 0, "x "], [0, 0, ""]]}),
        # no conditions
        (["A", "B"], {"sel": 1, "agg": 5, "conds": []}),
    ],
)
def test_round_trip_on_hard_cases(header, sql):
    assert parse_sql(render_sql(sql, header), header) == canonical_sql(sql)


def test_values_come_back_as_their_text():
    sql = {"sel": 0, "agg": 0, "conds": [[1, 0, 3], [1, 1, 2.5], [1, 2, -0.30000000000000004]]}
    assert parse_sql(render_sql(sql, HEADER), HEADER)["conds"] == [
        [1, 0, "3"],
        [1, 1, "2.5"],
        [1, 2, "-0.30000000000000004"],
    ]


def test_parser_reads_the_sql_symbol_for_less_than():
    assert parse_sql("SELECT Player FROM table WHERE No. < 3", HEADER)["conds"] == [[1, 2, "3"]]


def test_parser_forgives_case_and_spacing_of_model_output():
    text = "select count school/club team  from table where no. = 3 and position = Guard"
    assert parse_sql(text, HEADER) == {"sel": 5, "agg": 3, "conds": [[1, 0, "3"], [3, 0, "Guard"]]}


@pytest.mark.parametrize(
    "text, message",
    [
        ("COUNT Player FROM table", "expected 'SELECT '"),
        ("SELECT Coach FROM table", "expected a column name at character 7"),
        ("SELECT Player FROM players", "expected 'FROM table'"),
        ("SELECT Player FROM table WHERE Coach = 3", "expected a column name at character 31"),
        ("SELECT Player FROM table WHERE No. is 3", "expected an operator"),
        ("SELECT Player FROM table ORDER BY No.", "expected 'WHERE' or the end"),
    ],
)
def test_parse_errors_say_where_and_what(text, message):
    with pytest.raises(SQLParseError) as error:
        parse_sql(text, HEADER)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def _round_trip_failures(questions, headers):
    failures, checked = [], 0
    for question in questions:
        header = headers[question["table_id"]]
        checked += 1
        if parse_sql(render_sql(question["sql"], header), header) != canonical_sql(question["sql"]):
            failures.append(question)
    return checked, failures


def test_round_trip_is_exact_on_every_sample_question():
    questions, headers = [], {}
    for split in SPLITS:
        records, tables = load_split("sample", split)
        questions += records
        headers.update({table_id: table["header"] for table_id, table in tables.items()})
    checked, failures = _round_trip_failures(questions, headers)
    assert (checked, failures) == (1200, [])


@pytest.mark.parametrize("stem, known", [("dev", 103), ("test", 102)])
def test_round_trip_is_exact_on_every_release_question_with_a_known_header(shared_data_dir, stem, known):
    headers = {
        table_id: table["header"] for split in SPLITS for table_id, table in load_split("sample", split)[1].items()
    }
    with open(shared_data_dir / "wikisql" / "original" / f"{stem}.jsonl") as lines:
        questions = [question for question in map(json.loads, lines) if question["table_id"] in headers]
    checked, failures = _round_trip_failures(questions, headers)
    assert failures == []
    assert checked == known  # every release question on the sample's tables of that split
