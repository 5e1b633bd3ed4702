"""WikiSQL's tables as its official engine runs queries on them (``lib/dbengine.py`` in salesforce/WikiSQL).

Every table lives in an in-memory SQLite database with ``colN`` columns typed TEXT or REAL; text is compared
case-insensitively (stored and compared lowercased), condition values on REAL columns are read as numbers
(``"1,000"`` is 1000, ``"12 km"`` is 12), and the aggregation runs in SQL. Execution accuracy
(:mod:`textsql.scoring.evaluate`), execution guidance (:mod:`textsql.inference.guidance`) and the served model's
answers (:mod:`textsql.inference.serving`) all run queries here.
"""

from __future__ import annotations

import math
import re
import sqlite3
from typing import Any, Self

from textsql.constants import AGG_OPS, COND_OPS
from textsql.errors import DataError

# A whole value written as a number, with optional thousands separators: "1,234.5", "-3", ".5".
_WHOLE_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d+)?")
# The first number inside other text ("12 km", "approx. 3.5"), as the official engine falls back to.
_NUMBER_INSIDE = re.compile(r"[-+]?\d*\.\d+|\d+")


class ExecutionError(Exception):
    """A query could not run against its table (counts as a wrong prediction, never escapes)."""


def to_number(value: Any) -> float:
    """Read a cell or condition value the way WikiSQL's engine reads values of ``real`` columns.

    :param value: a number, or text such as ``"1,000"``, ``"3.5"`` or ``"12 km"``.
    :rtype: float
    :raises ValueError: when the text holds no number.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    if text and any(c.isdigit() for c in text) and _WHOLE_NUMBER.fullmatch(text):
        return float(text.replace(",", ""))
    found = _NUMBER_INSIDE.search(text)
    if found is None:
        raise ValueError(f"no number in {text!r}")
    return float(found.group())


class TableEngine:
    """WikiSQL tables in one in-memory SQLite database, created on first use.

    Usage::

        >>> with TableEngine({"t1": {"header": ["Name", "Age"], "types": ["text", "real"],
        ...                          "rows": [["Ann", 30], ["Bob", 41]]}}) as engine:
        ...     engine.execute("t1", {"sel": 0, "agg": 0, "conds": [[1, 1, "35"]]})
        ['bob']
    """

    def __init__(self, tables: dict[str, dict]):
        self.tables = tables
        self._connection = sqlite3.connect(":memory:")
        self._names: dict[str, str] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._connection.close()

    def execute(self, table_id: str, query: dict) -> list:
        """Run a structured query and return its result list (text lowercased).

        :param table_id: the question's table.
        :param query: ``{"sel", "agg", "conds"}``.
        :rtype: list
        :raises ExecutionError: for an unknown column, aggregation or operator, a non-number
            compared with a ``real`` column, or anything SQLite refuses.
        """
        name = self._table(table_id)
        types = self.tables[table_id]["types"]
        try:
            sel, agg = int(query["sel"]), int(query["agg"])
            select = _column(sel, types)
            if not 0 <= agg < len(AGG_OPS):
                raise ExecutionError(f"aggregation index {agg!r} out of range")
            if AGG_OPS[agg]:
                select = f"{AGG_OPS[agg]}({select})"
            clauses, values = [], []
            for col, op, value in query["conds"]:
                column = _column(int(col), types)
                if not 0 <= int(op) < len(COND_OPS):
                    raise ExecutionError(f"operator index {op!r} out of range")
                if isinstance(value, str):
                    value = value.lower()
                if types[int(col)] == "real" and not isinstance(value, (int, float)):
                    value = to_number(value)
                clauses.append(f"{column} {COND_OPS[int(op)]} ?")
                values.append(value)
        except (KeyError, TypeError, ValueError) as error:
            raise ExecutionError(f"malformed query {query!r}: {error}") from None
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        try:
            rows = self._connection.execute(f"SELECT {select} FROM {name}{where}", values).fetchall()
        except (sqlite3.Error, OverflowError) as error:
            raise ExecutionError(str(error)) from None
        return [row[0] for row in rows]

    def _table(self, table_id: str) -> str:
        if table_id in self._names:
            return self._names[table_id]
        table = self.tables.get(table_id)
        if table is None:
            raise DataError(
                f"no table {table_id!r} among {len(self.tables)} loaded; pass --tables the split's tables file"
            )
        types = table["types"]
        name = f"t{len(self._names)}"
        columns = ", ".join(f"col{i} {'REAL' if kind == 'real' else 'TEXT'}" for i, kind in enumerate(types))
        self._connection.execute(f"CREATE TABLE {name} ({columns})")
        cells = [[_stored(cell, kind) for cell, kind in zip(row, types)] for row in table["rows"]]
        if cells:
            marks = ", ".join("?" * len(types))
            self._connection.executemany(f"INSERT INTO {name} VALUES ({marks})", cells)
        self._names[table_id] = name
        return name


def _column(index: int, types: list[str]) -> str:
    if not 0 <= index < len(types):
        raise ExecutionError(f"column index {index!r} out of range (table has {len(types)} columns)")
    return f"col{index}"


def _stored(cell: Any, kind: str) -> Any:
    """A cell as the engine stores it: numbers in ``real`` columns, lowercased text elsewhere."""
    if kind == "real":
        try:
            number = to_number(cell)
        except ValueError:
            return str(cell).lower()
        return number if math.isfinite(number) else str(cell).lower()
    return str(cell).lower()
