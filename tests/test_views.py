"""Notebook 03's views: accuracy by query type as bars, predictions beside their gold SQL."""
from __future__ import annotations

import matplotlib

from textsql.evaluate import evaluate
from textsql.files import write_jsonl
from textsql.views import plot_accuracy_by_type, predictions_table

matplotlib.use("Agg")

COUNT = {"sel": 0, "agg": 3, "conds": [[1, 0, "3"]]}
PLAIN = {"sel": 1, "agg": 0, "conds": []}
LONG_GOLD = "SELECT Player FROM table WHERE School/Club Team = A school whose name is longer than fifty characters"
LINES = [
    {"id": "1", "question": "How many wear 3?", "pred_sql": "SELECT COUNT Player ...", "query": COUNT, "error": None, "gold_sql": "SELECT COUNT ...", "gold_query": COUNT},
    {"id": "2", "question": "Which number?", "pred_sql": "SELECT Player", "query": {**PLAIN, "sel": 0}, "error": None, "gold_sql": LONG_GOLD, "gold_query": PLAIN},
    {"id": "3", "question": "Nonsense?", "pred_sql": "SELECT SELECT", "query": None, "error": "no column", "gold_sql": "SELECT No.", "gold_query": PLAIN},
]


def test_bars_per_query_type_with_their_values():
    metrics = evaluate(None, LINES)
    by_aggregation, by_conditions = plot_accuracy_by_type(metrics).axes
    assert [tick.get_text() for tick in by_aggregation.get_xticklabels()] == ["none\nn=2", "COUNT\nn=1"]
    assert [bar.get_height() for bar in by_aggregation.patches] == [0.0, 100.0]
    assert [tick.get_text() for tick in by_conditions.get_xticklabels()] == ["0\nn=2", "1\nn=1"]
    assert [text.get_text() for text in by_conditions.texts] == ["0%", "100%"], "each bar says its value, 0 % included"


def test_predictions_beside_gold_whole_and_the_wrong_ones_errors_first(tmp_path):
    path = write_jsonl(tmp_path / "predictions.jsonl", LINES)
    table = predictions_table(path)
    assert list(table.data["right"]) == [True, False, False]
    assert LONG_GOLD in table.to_html(), "the gold SQL is shown whole"
    worst = predictions_table(path, wrong_only=True).data
    assert list(worst["question"]) == ["Nonsense?", "Which number?"]
    assert len(predictions_table(path, limit=1).data) == 1
