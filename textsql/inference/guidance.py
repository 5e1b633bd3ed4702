"""Execution-guided decoding: among a question's beams, the first whose query runs on its table.

A beam search returns its hypotheses best first; when the question's table carries rows, a query
that fails to execute (a number compared with a text column, say) or finds nothing is most likely
wrong, so :class:`ExecutionGuide` answers with the first beam whose query parses, executes on the
table (WikiSQL's own SQLite engine, :class:`textsql.scoring.engine.TableEngine`) and returns a non-empty
result, and with the first beam when none does (Wang et al. 2018, "Robust Text-to-SQL Generation with
Execution-Guided Decoding").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Self

from textsql.data.sql import parse_sql
from textsql.errors import SQLParseError
from textsql.scoring.engine import ExecutionError, TableEngine

logger = logging.getLogger(__name__)


class ExecutionGuide:
    """Picks a question's answer among its beams by running them on the tables that carry rows.

    Usage::

        >>> with ExecutionGuide({"t1": {"header": ["Name", "Age"], "types": ["text", "real"],
        ...                             "rows": [["Ann", 30]]}}) as guide:
        ...     guide.choose(["SELECT Name FROM table WHERE Age > 40", "SELECT Name FROM table WHERE Age > 20"],
        ...                  ["Name", "Age"], "t1")
        'SELECT Name FROM table WHERE Age > 20'

    :param tables: ``{table_id: table}`` in the release's form; tables without rows are not used.
    """

    def __init__(self, tables: dict[str, dict]):
        self.tables = {table_id: table for table_id, table in tables.items() if table.get("rows")}
        self.engine = TableEngine(self.tables)
        self.changed = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self.changed:
            logger.info("execution guidance chose another beam than the best for %d questions", self.changed)
        self.engine.close()

    def choose(self, candidates: Sequence[str], header: list[str], table_id: str | None) -> str:
        """The first candidate whose query executes with a result, else the first candidate.

        :param candidates: a question's beams, best first.
        :param header: the table's column names.
        :param table_id: the question's table (``None`` or a table without rows: the first candidate).
        :rtype: str
        """
        if table_id not in self.tables:
            return candidates[0]
        for rank, text in enumerate(candidates):
            if self._answers(text, header, table_id):
                self.changed += rank > 0
                return text
        return candidates[0]

    def _answers(self, text: str, header: list[str], table_id: str) -> bool:
        try:
            result = self.engine.execute(table_id, parse_sql(text, header))
        except (SQLParseError, ExecutionError):
            return False
        # An aggregate over no rows is one NULL: found nothing, like an empty list.
        return any(value is not None for value in result)
