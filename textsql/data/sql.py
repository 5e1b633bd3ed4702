"""WikiSQL structured queries as T5 target text, and that text read back given the table's header.

A query ``{"sel": 5, "agg": 3, "conds": [[1, 0, "3"]]}`` over the header
``["Player", "No.", ..., "School/Club Team"]`` is written as::

    SELECT COUNT School/Club Team FROM table WHERE No. = 3

Column names and values are written as they are (no quotes): column names may contain spaces,
commas, operators and SQL words, and values may contain `` AND ``, so :func:`parse_sql` matches the
text against the header's names and backtracks over the places a value could end. "Less than" is
written ``LT`` (:data:`textsql.constants.COND_OP_TEXT`) because T5's vocabulary has no ``<``;
the parser also accepts ``<`` from hand-written SQL.

Values: WikiSQL's question files hold a value as a JSON string or number, and which one the
annotation used is arbitrary (``No. = "3"`` beside ``Year = 1998``); the official logical-form
comparison (``lib/query.py``) compares ``str(value).lower()``. The text keeps a value's ``str`` form
with its case, so :func:`parse_sql` returns every value as that string: the round trip is exact
against :func:`canonical_sql`, which is the gold query with each value in its ``str`` form.
"""

from __future__ import annotations

import logging
from typing import Any

from textsql.constants import AGG_OPS, COND_OP_TEXT, COND_OPS, SQL_TABLE_NAME
from textsql.errors import DataError, SQLParseError

logger = logging.getLogger(__name__)

_SELECT = "SELECT "
_FROM = f" FROM {SQL_TABLE_NAME}"
_WHERE = " WHERE "
_AND = " AND "
# The spellings the parser reads for each operator index: ours first, then the SQL symbol.
_OP_SPELLINGS = tuple(tuple(dict.fromkeys((text, symbol))) for text, symbol in zip(COND_OP_TEXT, COND_OPS))


def value_text(value: Any) -> str:
    """The text form of a WikiSQL condition value: ``str(value)``, as WikiSQL's own comparison uses.

    :param value: a string or number from a ``conds`` entry.
    :rtype: str
    """
    return str(value)


def canonical_sql(sql: dict) -> dict:
    """A structured query with each value in its text form: what :func:`parse_sql` returns.

    :param sql: ``{"sel": int, "agg": int, "conds": [[col, op, value], ...]}``.
    :rtype: dict
    """
    return {
        "sel": int(sql["sel"]),
        "agg": int(sql["agg"]),
        "conds": [[int(col), int(op), value_text(value)] for col, op, value in sql["conds"]],
    }


def render_sql(sql: dict, header: list[str]) -> str:
    """Write a structured WikiSQL query as target text.

    Usage::

        >>> render_sql({"sel": 1, "agg": 3, "conds": [[0, 2, 3]]}, ["No.", "Team"])
        'SELECT COUNT Team FROM table WHERE No. LT 3'

    :param sql: ``{"sel": int, "agg": int, "conds": [[col, op, value], ...]}``.
    :param header: the table's column names, in order.
    :rtype: str
    """

    def column(index: int) -> str:
        if not 0 <= index < len(header):
            raise DataError(
                f"query refers to column {index} but the table has {len(header)} columns; check its table_id and header"
            )
        return header[index]

    if not 0 <= sql["agg"] < len(AGG_OPS):
        raise DataError(f"aggregation index {sql['agg']!r} is not one of 0..{len(AGG_OPS) - 1}")
    aggregation = AGG_OPS[sql["agg"]]
    text = _SELECT + (f"{aggregation} " if aggregation else "") + column(sql["sel"]) + _FROM
    conditions = []
    for col, op, value in sql["conds"]:
        if not 0 <= op < len(COND_OP_TEXT):
            raise DataError(f"operator index {op!r} is not one of 0..{len(COND_OP_TEXT) - 1}")
        conditions.append(f"{column(col)} {COND_OP_TEXT[op]} {value_text(value)}")
    if conditions:
        text += _WHERE + _AND.join(conditions)
    return text


def parse_sql(text: str, header: list[str]) -> dict:
    """Read target text back into a structured query, given the table's header.

    Column names are matched exactly first; if that fails, again ignoring case and runs of
    whitespace (what a model's decoded output may differ in). Values come back as strings.

    Usage::

        >>> parse_sql("SELECT COUNT Team FROM table WHERE No. LT 3 AND Team = A AND B", ["No.", "Team"])
        {'sel': 1, 'agg': 3, 'conds': [[0, 2, '3'], [1, 0, 'A AND B']]}

    :param text: ``SELECT [AGG] column FROM table [WHERE column op value [AND ...]]``.
    :param header: the table's column names, in order.
    :raises SQLParseError: the text does not read as a query over this header.
    :rtype: dict
    """
    exact = _Parser(text, header, fold=False)
    result = exact.parse()
    if result is None:
        result = _Parser(text, header, fold=True).parse()
    if result is None:
        raise SQLParseError(exact.failure())
    return result


def parsed(text: str, header: list[str]) -> dict:
    """``{"query": ..., "error": None}`` when the text reads as WikiSQL over the header, else the reason.

    :rtype: dict
    """
    try:
        return {"query": parse_sql(text, header), "error": None}
    except SQLParseError as error:
        return {"query": None, "error": str(error)}


def _fold(text: str) -> str:
    return " ".join(text.split()).lower()


class _Parser:
    """Backtracking reader of one text against one header; remembers how far it got for the error."""

    def __init__(self, text: str, header: list[str], *, fold: bool):
        # Folding keeps positions aligned only when lowercasing keeps the length (true for
        # everything but a few special letters); otherwise fall back to the text as it is.
        self.text = " ".join(text.split()) if fold else text
        folded = self.text.lower() if fold else self.text
        self.key_text = folded if len(folded) == len(self.text) else self.text
        self.fold = fold
        self.header = header
        self.names = [_fold(name) for name in header] if fold else list(header)
        # Longest names first, so "Points for" is tried before "Points"; ties keep header order.
        self.columns = sorted(range(len(header)), key=lambda index: -len(self.names[index]))
        self.furthest = (0, "'SELECT '")
        self.memo: dict[int, list | None] = {}

    def at(self, position: int, word: str) -> bool:
        """Whether a keyword or operator is at ``position``."""
        return self.key_text.startswith(word.lower() if self.fold else word, position)

    def find_and(self, position: int) -> int:
        return self.key_text.find(_AND.lower() if self.fold else _AND, position)

    def expect(self, position: int, what: str) -> None:
        if position >= self.furthest[0]:
            self.furthest = (position, what)

    def failure(self) -> str:
        position, what = self.furthest
        got = self.text[position : position + 30] or "the end"
        return (
            f"cannot read {self.text!r} as WikiSQL over a {len(self.header)}-column header: expected {what} "
            f"at character {position}, got {got!r}; write SELECT [AGG] column FROM table [WHERE column op value AND ...] "
            f"with column names from the header {self.header!r}"
        )

    def columns_at(self, position: int) -> list[int]:
        found = [
            index
            for index in self.columns
            if self.names[index] and self.key_text.startswith(self.names[index], position)
        ]
        if not found:
            self.expect(position, "a column name")
        return found

    def parse(self) -> dict | None:
        if not self.at(0, _SELECT):
            return None
        start = len(_SELECT)
        choices = [
            (agg, start + len(AGG_OPS[agg]) + 1) for agg in range(1, len(AGG_OPS)) if self.at(start, AGG_OPS[agg] + " ")
        ]
        for agg, position in choices + [(0, start)]:
            for sel in self.columns_at(position):
                after = position + len(self.names[sel])
                if not self.at(after, _FROM):
                    self.expect(after, f"{_FROM.strip()!r}")
                    continue
                after += len(_FROM)
                if after == len(self.text):
                    return {"sel": sel, "agg": agg, "conds": []}
                if not self.at(after, _WHERE):
                    self.expect(after, f"{_WHERE.strip()!r} or the end")
                    continue
                conds = self.conditions(after + len(_WHERE))
                if conds is not None:
                    return {"sel": sel, "agg": agg, "conds": conds}
        return None

    def conditions(self, position: int) -> list | None:
        """The conditions from ``position`` to the end, or None if they cannot be read."""
        if position not in self.memo:
            self.memo[position] = self._conditions(position)
        return self.memo[position]

    def _conditions(self, position: int) -> list | None:
        for col in self.columns_at(position):
            after = position + len(self.names[col])
            if not self.at(after, " "):
                self.expect(after, "a space after the column name")
                continue
            after += 1
            for op, spellings in enumerate(_OP_SPELLINGS):
                for spelling in spellings:
                    end_of_op = after + len(spelling)
                    if not self.at(after, spelling):
                        continue
                    if end_of_op == len(self.text):
                        return [[col, op, ""]]
                    if not self.at(end_of_op, " "):
                        continue
                    value_start = end_of_op + 1
                    # The shortest value after which the rest reads as conditions; else the rest.
                    split = self.find_and(value_start)
                    while split != -1:
                        rest = self.conditions(split + len(_AND))
                        if rest is not None:
                            return [[col, op, self.text[value_start:split]]] + rest
                        split = self.find_and(split + 1)
                    return [[col, op, self.text[value_start:]]]
            self.expect(after, f"an operator ({', '.join(repr(s) for spellings in _OP_SPELLINGS for s in spellings)})")
        return None
