"""Synthetic WikiSQL questions over the sample's headers (textsql.data.synthetic): grammar, rows, splits."""

import re
from collections import Counter

import pytest

from textsql.constants import AGG_OPS, COND_OPS, SPLITS
from textsql.data.prepare import prepare
from textsql.data.sql import parse_sql, render_sql
from textsql.data.synthetic import (
    FULL,
    MAX_CONDITIONS,
    QUESTIONS,
    TEST_HEADERS,
    Synthesis,
    load_synthetic_split,
    split_headers,
)
from textsql.data.tables import load_tables, prepared_tables_path
from textsql.data.wikisql import load_split
from textsql.pipeline.parameters import declared_defaults
from textsql.scoring.engine import TableEngine
from textsql.scoring.evaluate import evaluate

RECORD_KEYS = {"id", "table_id", "question", "header", "types", "rows", "sql"}
NUMERIC_AGGREGATIONS = {AGG_OPS.index(name) for name in ("MAX", "MIN", "SUM", "AVG")}


@pytest.fixture(scope="module")
def synthetic():
    return {split: load_synthetic_split(split) for split in SPLITS}


def test_the_same_call_gives_the_same_questions():
    first, second = load_synthetic_split("validation"), load_synthetic_split("validation")
    assert first == second
    assert load_synthetic_split("validation", limit=5)[0] == first[0][:5]


def test_the_test_split_is_large_enough_to_trust():
    # About 1.5 points of standard error on 1,000 questions, over more tables than validation, none in training.
    headers = split_headers()
    test_headers = {tuple(header) for header, _ in headers["test"]}
    assert QUESTIONS["test"] >= 1000 and len(test_headers) == TEST_HEADERS >= 60 > len(headers["validation"])
    records, tables = load_synthetic_split("test")
    assert len(tables) == TEST_HEADERS and min(Counter(record["table_id"] for record in records).values()) >= 13
    assert not test_headers & {tuple(header) for header, _ in headers["train"]}
    assert split_headers.__wrapped__(FULL) == headers, "drawn again, the same headers"


def test_held_out_tables_share_no_column_name_with_training(synthetic):
    names = {
        split: {name.lower() for records, _ in [synthetic[split]] for record in records for name in record["header"]}
        for split in SPLITS
    }
    assert names["train"] and names["validation"] and names["test"]
    # Far more training column names than a small model can memorise (the first version had 618, all memorised).
    assert len(names["train"]) > 10_000
    assert not names["train"] & names["validation"] and not names["train"] & names["test"]
    # The real sample's dev and test tables are not trained on either, so its validation questions are unseen tables.
    _, real_tables = load_split("sample", "validation")
    train_headers = {tuple(header) for header, _ in split_headers()["train"]}
    assert not train_headers & {tuple(table["header"]) for table in real_tables.values()}


def test_queries_follow_wikisql_grammar_and_fit_column_types(synthetic):
    for split, (records, tables) in synthetic.items():
        assert len(records) == FULL.questions(split) and len({record["question"] for record in records}) > 0.95 * len(
            records
        )
        for record in records:
            assert record.keys() == RECORD_KEYS and record["table_id"] in tables
            sql, types = record["sql"], record["types"]
            columns = [col for col, _, _ in sql["conds"]]
            assert len(columns) <= MAX_CONDITIONS and len(set(columns)) == len(columns) and sql["sel"] not in columns
            if sql["agg"] in NUMERIC_AGGREGATIONS:
                assert types[sql["sel"]] == "real", record
            for col, op, _ in sql["conds"]:
                assert COND_OPS[op] == "=" or types[col] == "real", record


def test_condition_values_are_verbatim_in_the_question_and_the_text_round_trips(synthetic):
    records, _ = synthetic["train"]
    for record in records:
        for _, _, value in record["sql"]["conds"]:
            # A clause may end right after the value: "When Year is 2011, ..." (the grammar drops the comma).
            assert re.search(rf"(^| ){re.escape(value)}[,?]?( |$)", record["question"]), record
        assert parse_sql(render_sql(record["sql"], record["header"]), record["header"]) == record["sql"]


def test_every_gold_query_finds_rows_of_its_table(synthetic):
    for split, (records, tables) in synthetic.items():
        assert all(len(table["rows"]) > 1 for table in tables.values())
        # Every held-out question; of training's stream, one question of every table (they take the tables in turn).
        asked = records[: len(tables)] if split == "train" else records
        assert {record["table_id"] for record in asked} == tables.keys()
        with TableEngine(tables) as engine:
            for record in asked:
                assert engine.execute(record["table_id"], record["sql"]), record


def test_questions_vary_in_their_words_not_only_their_names(synthetic):
    records, _ = synthetic["train"]
    openings = {" ".join(record["question"].split()[:2]) for record in records}
    aggregations = {record["sql"]["agg"] for record in records}
    counts = {len(record["sql"]["conds"]) for record in records}
    assert len(openings) > 30 and aggregations == set(range(len(AGG_OPS))) and counts == set(range(MAX_CONDITIONS + 1))


def test_training_asks_for_long_where_clauses_more_often_and_held_out_splits_keep_wikisqls_mix(synthetic):
    # A model that rarely sees three or four conditions learns to write only the first and the last of them.
    def long_share(split):
        records, _ = synthetic[split]
        return sum(len(record["sql"]["conds"]) >= 3 for record in records) / len(records)

    assert long_share("train") > 2 * long_share("test") and long_share("test") < 0.15
    # Training's mix is its own: the held-out questions every score is measured on stay as they are.
    only_one_condition = Synthesis(training_condition_weights=(0, 1, 0, 0, 0))
    assert load_synthetic_split("test", synthesis=only_one_condition) == synthetic["test"]
    assert {len(record["sql"]["conds"]) for record in load_synthetic_split("train", 50, only_one_condition)[0]} == {1}


def test_the_demos_training_never_sees_a_question_twice(synthetic):
    # Questions are a stream the demo's steps consume once, not a set it learns by heart.
    training = declared_defaults("02_train_distributed")
    ranks = training["workers"] * max(1, training["worker_gpus"])  # one rank a worker on CPUs
    consumed = training["max_steps"] * training["per_device_train_batch_size"] * ranks
    records, _ = synthetic["train"]
    assert len(records) >= consumed and len({record["question"] for record in records}) > 0.99 * len(records)


def test_mixed_source_holds_both_with_distinct_ids():
    sample, _ = load_split("sample", "validation")
    synthetic, _ = load_synthetic_split("validation")
    mixed, tables = load_split("sample+synthetic", "validation")
    assert mixed == sample + synthetic
    assert len({record["id"] for record in mixed}) == len(mixed)
    assert {record["table_id"] for record in mixed} == set(tables)


def test_prepare_writes_tables_with_rows_so_execution_accuracy_is_measured(tmp_path):
    out = tmp_path / "data"
    summary = prepare(source="synthetic", data_dir=str(out), limit=20)
    assert summary["source"] == "synthetic" and summary["counts"] == {split: 20 for split in SPLITS}
    tables = load_tables(prepared_tables_path(out, "validation"))
    records, _ = load_synthetic_split("validation", limit=20)
    assert all(tables[record["table_id"]]["rows"] for record in records)
    report = evaluate(records, [{"id": record["id"], "query": record["sql"]} for record in records], tables=tables)
    assert report["lf_accuracy"] == 1.0 and report["ex_accuracy"] == 1.0
