"""WikiSQL's own metrics: logical-form accuracy and execution accuracy.

Both follow the official release (``evaluate.py``, ``lib/query.py``, ``lib/dbengine.py`` in
salesforce/WikiSQL), re-implemented here so that scores are comparable with the leaderboard:

* logical form: ``sel`` and ``agg`` equal, and the conditions equal as a set of
  ``(column, operator, str(value).lower())`` (as a list when ``ordered``). A prediction that is an
  error, or malformed, is wrong. As in the official code, ``"3"`` matches ``3`` but not ``3.0``.
* execution: gold and predicted queries run on the question's table (:class:`~textsql.scoring.engine.TableEngine`,
  the official engine's reading of values) and their result lists must be equal. A query that fails to execute
  is wrong.

Gold comes as the release's question files (``{"table_id", "question", "sql"}``) or as our records
(which also carry the table); predictions as the official format (one ``{"query": ...}`` or
``{"error": ...}`` line per gold line) or as our ``predictions.jsonl`` (matched by ``id``).

Each accuracy comes with its standard error (:func:`standard_error`): on 200 questions a score of 50 % is give or
take 3.5 points, so a difference of five points between two models may be noise.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from textsql.constants import AGG_OPS
from textsql.data.tables import load_tables
from textsql.errors import DataError
from textsql.json_files import read_jsonl
from textsql.scoring.engine import ExecutionError, TableEngine

logger = logging.getLogger(__name__)

# What a gold or prediction source may be: a JSON-lines file or dicts already in memory.
Source = str | Path | Iterable[dict]

# The parts of a logical form, in logical_form_key's order, scored separately in "components".
COMPONENTS = ("sel", "agg", "where")


@dataclass(frozen=True)
class Grade:
    """How one prediction scored."""

    agg: int
    n_conds: int
    lf: bool
    ex: bool | None
    error: str | None = None
    # Which parts of the logical form matched (select column, aggregation, WHERE clause): the
    # component accuracies of the WikiSQL literature, which show a model learning long before whole
    # queries come out right.
    parts: tuple[bool, bool, bool] = (False, False, False)
    # A query whose columns belong to its table (when the table's width is known).
    parsed: bool = False


def logical_form_key(query: dict, ordered: bool = False) -> tuple:
    """The part of a structured query that the official logical-form match compares.

    :param query: ``{"sel": int, "agg": int, "conds": [[col, op, value], ...]}``.
    :param ordered: compare conditions as a list (official ``--ordered``) instead of a set.
    :rtype: tuple
    """
    conds = [(col, op, str(value).lower()) for col, op, value in query["conds"]]
    return query["sel"], query["agg"], tuple(conds) if ordered else frozenset(conds)


def evaluate(
    gold: Source | None, pred: Source, tables: str | Path | dict[str, dict] | None = None, ordered: bool = False
) -> dict:
    """Score predictions with WikiSQL's logical-form and execution accuracy.

    Usage::

        >>> gold = [{"table_id": "t", "sql": {"sel": 0, "agg": 0, "conds": [[1, 0, "Ann"]]}}]
        >>> evaluate(gold, [{"query": {"sel": 0, "agg": 0, "conds": [[1, 0, "ann"]]}}])["lf_accuracy"]
        1.0

    :param gold: release question file or our records (path or dicts); ``None`` takes the gold
        queries that our ``predictions.jsonl`` lines carry (``gold_query``).
    :param pred: official predictions (one line per gold line) or ours (with ``id``), path or dicts.
    :param tables: a ``*.tables.jsonl`` path or ``{table_id: table}``; by default the tables carried
        by gold records. Without rows, ``ex_accuracy`` is ``None``.
    :param ordered: compare conditions in order (official ``--ordered``).
    :returns: ``n``, ``lf_accuracy``, ``ex_accuracy``, counts, ``parse_rate`` (share of predictions
        that are queries whose columns belong to their table), ``components`` (per-part accuracy),
        ``baseline`` (the same scores of the trivial query: the most common aggregation of these
        questions, the first column, no condition), and ``by_aggregation`` / ``by_conditions``
        breakdowns with the keys of the whole.
    :rtype: dict
    """
    pred_items = _as_list(pred)
    gold_items = _as_list(gold) if gold is not None else _embedded_gold(pred_items)
    pred_items = _align(gold_items, pred_items)
    if isinstance(tables, (str, Path)):
        tables = load_tables(tables)
    elif tables is None:
        tables = {item["table_id"]: item for item in gold_items if "rows" in item and "types" in item}
    executable = bool(tables) and any(table.get("rows") for table in tables.values())
    widths = {item["table_id"]: len(item["header"]) for item in gold_items if isinstance(item.get("header"), list)}
    widths.update({table_id: len(table["header"]) for table_id, table in (tables or {}).items() if "header" in table})
    baseline = {"sel": 0, "agg": _most_common_aggregation(gold_items), "conds": []}
    with TableEngine(tables if executable else {}) as engine:
        scoring = (engine if executable else None, ordered)
        grades = [
            _grade(index, g, p, *scoring, widths.get(g.get("table_id")))
            for index, (g, p) in enumerate(zip(gold_items, pred_items))
        ]
        baseline_grades = [_grade(index, g, {"query": baseline}, *scoring) for index, g in enumerate(gold_items)]
    report = _summary(grades)
    report["ordered"] = ordered
    report["components"] = _components(grades)
    report["baseline"] = {"query": baseline, **_summary(baseline_grades), "components": _components(baseline_grades)}
    report["by_aggregation"] = _breakdown(grades, lambda grade: (grade.agg, AGG_OPS[grade.agg] or "none"))
    report["by_conditions"] = _breakdown(grades, lambda grade: (grade.n_conds, str(grade.n_conds)))
    logger.info(
        "n=%d lf_accuracy=%.4f ex_accuracy=%s", report["n"], report["lf_accuracy"] or 0.0, report["ex_accuracy"]
    )
    return report


def _components(grades: list[Grade]) -> dict[str, float | None]:
    return {
        name: sum(grade.parts[position] for grade in grades) / len(grades) if grades else None
        for position, name in enumerate(COMPONENTS)
    }


def _most_common_aggregation(gold: list[dict]) -> int:
    """The aggregation most of these questions' gold queries use (the lowest index on a tie)."""
    counts = Counter(int(_gold_query(item, index)["agg"]) for index, item in enumerate(gold))
    return min(counts, key=lambda agg: (-counts[agg], agg)) if counts else 0


def _as_list(source: Source) -> list[dict]:
    if isinstance(source, (str, Path)):
        return list(read_jsonl(source))
    return list(source)


def _embedded_gold(pred: list[dict]) -> list[dict]:
    if not all(isinstance(item.get("gold_query"), dict) and "id" in item for item in pred):
        raise DataError(
            "predictions without id and gold_query (not textsql infer's output); pass --gold the question file"
        )
    return [{"id": item["id"], "table_id": item.get("table_id"), "sql": item["gold_query"]} for item in pred]


def _align(gold: list[dict], pred: list[dict]) -> list[dict]:
    """Pair predictions with gold lines: by ``id`` when both have one, else line by line."""
    if gold and pred and all("id" in item for item in gold) and all("id" in item for item in pred):
        by_id = {str(item["id"]): item for item in pred}
        missing = [str(item["id"]) for item in gold if str(item["id"]) not in by_id]
        if missing:
            raise DataError(
                f"{len(missing)} gold questions have no prediction (first: {missing[0]!r}); predict the same split and --limit"
            )
        return [by_id[str(item["id"])] for item in gold]
    if len(gold) != len(pred):
        raise DataError(
            f"{len(gold)} gold lines but {len(pred)} predictions; official predictions need one line per gold line"
        )
    return pred


def _gold_query(item: dict, index: int) -> dict:
    sql = item.get("sql")
    if isinstance(sql, str):
        try:
            sql = json.loads(sql)
        except json.JSONDecodeError:
            sql = None
    if not isinstance(sql, dict) or not {"sel", "agg", "conds"} <= sql.keys() or "table_id" not in item:
        raise DataError(
            f"gold line {index + 1} has no table_id and sql {{sel, agg, conds}}; pass the release file or our records"
        )
    return sql


def _pred_query(item: dict) -> tuple[dict | None, str | None]:
    """The predicted structured query, or why there is none."""
    if item.get("error"):
        return None, str(item["error"])
    query = item.get("query")
    if not isinstance(query, dict) or not {"sel", "agg", "conds"} <= query.keys():
        return None, f"no query in prediction {item!r:.80}"
    return query, None


def _grade(
    index: int, gold: dict, pred: dict, engine: TableEngine | None, ordered: bool, width: int | None = None
) -> Grade:
    gold_query = _gold_query(gold, index)
    query, error = _pred_query(pred)
    if query is not None and width is not None and not _within(query, width):
        query, error = None, f"a column outside the table's {width} columns in {query!r}"
    lf, parts, parsed = False, (False, False, False), query is not None
    if query is not None:
        try:
            predicted, expected_form = logical_form_key(query, ordered), logical_form_key(gold_query, ordered)
            parts = tuple(a == b for a, b in zip(predicted, expected_form))
            lf = all(parts)
        except (TypeError, ValueError) as problem:
            error, parsed = f"malformed query: {problem}", False
    ex = None
    if engine is not None:
        try:
            expected = engine.execute(gold["table_id"], gold_query)
        except ExecutionError as problem:
            # The official script crashes here; a broken gold query scores nobody.
            logger.warning("gold query %d does not execute (%s); counted as wrong", index + 1, problem)
            expected, ex = None, False
        if expected is not None and query is not None and error is None:
            try:
                ex = engine.execute(gold["table_id"], query) == expected
            except ExecutionError as problem:
                ex, error = False, f"execution failed: {problem}"
        elif ex is None:
            ex = False
    return Grade(gold_query["agg"], len(gold_query["conds"]), lf, ex, error, parts, parsed)


def _within(query: dict, width: int) -> bool:
    try:
        return all(0 <= int(col) < width for col in [query["sel"], *(cond[0] for cond in query["conds"])])
    except (TypeError, ValueError, IndexError):
        return False


def standard_error(accuracy: float | None, n: int) -> float | None:
    """The standard error of an accuracy measured on ``n`` questions, ``sqrt(p (1 - p) / n)``: the spread of the
    score over other draws of as many questions (two of them either side hold the true accuracy 95 times in 100).

    Usage::

        >>> round(standard_error(0.5, 200), 4)
        0.0354

    :returns: ``None`` where the accuracy is.
    :rtype: float | None
    """
    if accuracy is None or not n:
        return None
    return math.sqrt(accuracy * (1 - accuracy) / n)


def _summary(grades: list[Grade]) -> dict:
    n = len(grades)
    lf_correct = sum(grade.lf for grade in grades)
    executed = [grade.ex for grade in grades if grade.ex is not None]
    ex_correct = sum(executed) if executed else None
    lf_accuracy = lf_correct / n if n else None
    ex_accuracy = ex_correct / n if ex_correct is not None and n else None
    return {
        "n": n,
        "lf_accuracy": lf_accuracy,
        "ex_accuracy": ex_accuracy,
        "lf_standard_error": standard_error(lf_accuracy, n),
        "ex_standard_error": standard_error(ex_accuracy, n),
        "lf_correct": lf_correct,
        "ex_correct": ex_correct,
        "errors": sum(grade.error is not None for grade in grades),
        "parse_rate": sum(grade.parsed for grade in grades) / n if n else None,
    }


def _breakdown(grades: list[Grade], key: Callable[[Grade], tuple[int, str]]) -> dict[str, dict]:
    """Summaries per group, keyed by name, in the order of the group's number."""
    groups: dict[tuple[int, str], list[Grade]] = defaultdict(list)
    for grade in grades:
        groups[key(grade)].append(grade)
    return {name: _summary(group) for (_, name), group in sorted(groups.items())}


def format_report(report: dict) -> str:
    """A short human-readable table of an :func:`evaluate` report.

    :param report: what :func:`evaluate` returned.
    :rtype: str
    """

    def percent(value: float | None) -> str:
        return "   n/a" if value is None else f"{100 * value:6.2f}"

    def scored(row: dict, key: str) -> str:
        """An accuracy and its standard error, in points: `` 52.50 ± 3.53``."""
        error = row.get(f"{key}_standard_error")
        return f"{percent(row[f'{key}_accuracy'])} {'' if error is None else f'± {100 * error:.2f}':>7}"

    lines = [
        f"{'':14} {'n':>6} {'LF % ± SE':>14} {'EX % ± SE':>14}",
        f"{'all':14} {report['n']:6d} {scored(report, 'lf')} {scored(report, 'ex')}",
    ]
    for title, section in (("agg", "by_aggregation"), ("conds", "by_conditions")):
        for name, row in report[section].items():
            lines.append(f"{title + ' ' + name:14} {row['n']:6d} {scored(row, 'lf')} {scored(row, 'ex')}")
    if report.get("parse_rate") is not None:
        lines.append(
            f"{'parsed':14} {percent(report['parse_rate']).strip()}% of predictions are queries over their table"
        )
    parts = report.get("components") or {}
    if parts:
        lines.append(
            "parts right    " + "  ".join(f"{name} {percent(value).strip()}%" for name, value in parts.items())
        )
    baseline = report.get("baseline")
    if baseline:
        aggregation = AGG_OPS[baseline["query"]["agg"]] or "no aggregation"
        lines.append(
            "baseline       "
            + "  ".join(f"{name} {percent(value).strip()}%" for name, value in baseline["components"].items())
            + f"  ({aggregation}, first column, no condition)"
        )
    return "\n".join(lines)
