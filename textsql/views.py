"""Notebook 03's views of a scored run: accuracy by query type as a plot, and predictions beside their gold SQL.

Both read what ``textsql infer`` wrote (``metrics.json``'s breakdowns, ``predictions.jsonl``), so the
notebook's cells stay one call each.
"""
from __future__ import annotations

import logging
from pathlib import Path

from textsql.evaluate import logical_form_key
from textsql.files import read_jsonl

logger = logging.getLogger(__name__)

# metrics.json's breakdowns, and how each is titled.
BREAKDOWNS = {"by_aggregation": "aggregation", "by_conditions": "WHERE conditions"}
SCORES = {"lf_accuracy": "logical form", "ex_accuracy": "execution"}
TABLE_COLUMNS = ["question", "pred_sql", "gold_sql", "right", "error"]


def plot_accuracy_by_type(metrics: dict):
    """Bars of logical-form (and, where scored, execution) accuracy per aggregation and per number of conditions.

    Each bar group is labelled with its share of the questions (``n``), since a type with two
    questions swings from 0 to 100 %.

    Usage::

        >>> plot_accuracy_by_type(summary["metrics"])          # doctest: +SKIP

    :param metrics: an :func:`textsql.evaluate.evaluate` report (``metrics.json``).
    :rtype: matplotlib.figure.Figure
    """
    import matplotlib.pyplot as plt
    import numpy as np

    scores = [key for key in SCORES if metrics.get(key) is not None]
    figure, panels = plt.subplots(1, len(BREAKDOWNS), figsize=(12, 4), sharey=True)
    for axes, (section, title) in zip(panels, BREAKDOWNS.items()):
        groups = metrics[section]
        positions = np.arange(len(groups))
        width = 0.8 / len(scores)
        for offset, key in enumerate(scores):
            values = [100 * (row[key] or 0.0) for row in groups.values()]
            bars = axes.bar(positions + (offset - (len(scores) - 1) / 2) * width, values, width, label=SCORES[key])
            # The value on each bar: a 0 % bar is otherwise invisible.
            axes.bar_label(bars, fmt="%.0f%%", fontsize=8)
        axes.set_xticks(positions, [f"{name}\nn={row['n']}" for name, row in groups.items()])
        axes.set_title(f"by {title}")
        axes.set_ylim(0, 100)
        axes.grid(axis="y", alpha=0.3)
    panels[0].set_ylabel("accuracy %")
    panels[0].legend()
    figure.tight_layout()
    return figure


def predictions_table(predictions: str | Path, limit: int = 8, wrong_only: bool = False):
    """Predicted SQL beside the gold SQL, one question a row, with whether the logical form is right.

    Shown whole and left-aligned (a DataFrame's own view cuts text at 50 characters, right-aligned), so the
    two queries can be read against each other.

    :param predictions: ``predictions.jsonl`` written by :func:`textsql.infer.predict`.
    :param limit: rows shown.
    :param wrong_only: only wrong predictions, those that are no query first.
    :returns: a pandas ``Styler``; its ``data`` is the ``DataFrame``.
    :rtype: pandas.io.formats.style.Styler
    """
    import pandas as pd

    rows = []
    for line in read_jsonl(predictions):
        right = line.get("query") is not None and line.get("gold_query") is not None and (
            logical_form_key(line["query"]) == logical_form_key(line["gold_query"]))
        rows.append({**{name: line.get(name) for name in TABLE_COLUMNS}, "right": right})
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    if wrong_only:
        table = table[~table["right"]].sort_values("error", key=lambda errors: errors.isna(), kind="stable")
    return table.head(limit).reset_index(drop=True).style.set_properties(**{"text-align": "left"}).set_table_styles(
        [{"selector": "th", "props": [("text-align", "left")]}])
