"""The evaluation's WikiSQL scores during training: each generated query matched to its question by input ids."""

from __future__ import annotations

import numpy as np
from transformers.trainer_utils import EvalPrediction

from textsql.data.prepare import PrepareArguments, prepare
from textsql.data.sql import render_sql
from textsql.data.wikisql import source_text
from textsql.model import load_tokenizer
from textsql.training.metrics import eval_questions, wikisql_metrics

HEADER = ["Player", "No.", "Team"]
TABLE = {
    "header": HEADER,
    "types": ["text", "real", "text"],
    "rows": [["Ann", 3, "Reds"], ["Bob", 7, "Blues"], ["Cid", 3, "Blues"]],
}
QUESTIONS = [
    ("Who wears number 7?", {"sel": 0, "agg": 0, "conds": [[1, 0, "7"]]}),
    ("How many players wear 3?", {"sel": 0, "agg": 3, "conds": [[1, 0, "3"]]}),
    ("Which team is Ann on?", {"sel": 2, "agg": 0, "conds": [[0, 0, "Ann"]]}),
]


def padded(rows: list[list[int]]) -> np.ndarray:
    """As the trainer gathers them: rows of different lengths padded with -100."""
    width = max(map(len, rows))
    return np.array([row + [-100] * (width - len(row)) for row in rows])


def test_scores_follow_the_inputs_not_the_order():
    tokenizer = load_tokenizer(None)
    questions = [
        {
            "id": str(index),
            "table_id": "t1",
            "header": HEADER,
            "sql": sql,
            "input_ids": tokenizer(source_text(question, HEADER))["input_ids"],
        }
        for index, (question, sql) in enumerate(QUESTIONS)
    ]
    # The sampler hands them back reordered. Predicted: the first right; the second the wrong condition
    # value but the same answer when executed (Ann and Cid both wear 3: COUNT is 2 either way, so
    # execution is right, logical form wrong); the third is no query at all.
    order = [2, 0, 1]
    predicted = {
        0: render_sql(QUESTIONS[0][1], HEADER),
        1: "SELECT COUNT Player FROM table WHERE No. = 3.0",
        2: "SELECT SELECT",
    }
    compute = wikisql_metrics(tokenizer, questions, {"t1": TABLE})
    scores = compute(
        EvalPrediction(
            predictions=padded([tokenizer(text_target=predicted[index])["input_ids"] for index in order]),
            label_ids=padded(
                [tokenizer(text_target=render_sql(QUESTIONS[index][1], HEADER))["input_ids"] for index in order]
            ),
            inputs=padded([questions[index]["input_ids"] for index in order]),
        )
    )
    assert scores["exact_match"] == 1 / 3
    assert scores["lf_accuracy"] == 1 / 3
    assert scores["parse_rate"] == 2 / 3
    assert scores["ex_accuracy"] == 2 / 3


def test_tables_without_rows_score_no_execution_and_the_split_loads(tmp_path):
    out = tmp_path / "data"
    prepare(PrepareArguments(data_dir=str(out), limit=4))
    questions, tables = eval_questions(out, 3)
    assert [item["id"] for item in questions] == [item["id"] for item in eval_questions(out, None)[0][:3]]
    tokenizer = load_tokenizer(None)
    targets = padded(
        [tokenizer(text_target=render_sql(item["sql"], item["header"]))["input_ids"] for item in questions]
    )
    scores = wikisql_metrics(tokenizer, questions, tables)(
        EvalPrediction(targets, targets, inputs=padded([item["input_ids"] for item in questions]))
    )
    assert scores == {"exact_match": 1.0, "lf_accuracy": 1.0, "parse_rate": 1.0}
