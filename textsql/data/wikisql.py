"""WikiSQL questions from any of its sources, as one record form, and the texts T5 reads and writes.

Sources (``--source``):

- ``sample`` (default): the real sample shipped in ``textsql/assets/wikisql_sample`` (see its NOTICE);
- a directory in the original release layout: ``{train,dev,test}.jsonl`` and ``{stem}.tables.jsonl``;
- ``hub``: ``Salesforce/wikisql`` at its parquet conversion (``refs/convert/parquet``), for connected machines.

Every source yields, per split, records ``{"id", "table_id", "question", "header", "types", "rows",
"sql": {"sel", "agg", "conds"}}`` and the tables those records use, in the release's table form
(``id``, ``header``, ``types``, ``rows``, ...). Record ids are ``{split}-{line index}``, the same for
every source holding the same release file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import Any

from textsql.constants import (
    AGG_OPS,
    COND_OPS,
    HUB_SOURCE,
    INPUT_FORMATS,
    PREPARE_JSON_NAME,
    RELEASE_SPLIT_FILES,
    SAMPLE_DATA_DIR,
    SAMPLE_SOURCE,
    SPLITS,
    UNCASED_FORMAT,
)
from textsql.data.sql import parse_sql, render_sql
from textsql.data.synthetic import FULL, SELECT_ONLY, load_synthetic_split
from textsql.data.tables import TABLES_SUFFIX, checked_table, load_tables
from textsql.errors import DataError, SQLParseError
from textsql.json_files import read_json, read_jsonl_located

logger = logging.getLogger(__name__)

# WikiSQL on the hub, as its parquet conversion (datasets >= 4 refuses the loading script).
HUB_DATASET = "Salesforce/wikisql"
HUB_REVISION = "refs/convert/parquet"
# The model's input text: the task prefix, the question, then the table's columns.
SQL_TASK_PREFIX = "translate to SQL: "
COLUMNS_MARKER = " columns: "
COLUMN_SEPARATOR = " | "

SYNTHETIC_SOURCE = FULL.name
# Questions without conditions over four-column training tables: the learning check's quick source.
SYNTHETIC_SELECT_SOURCE = SELECT_ONLY.name
# The sample's real questions and the synthetic ones together, in each split.
MIXED_SOURCE = f"{SAMPLE_SOURCE}+{SYNTHETIC_SOURCE}"
# Sources given by name; any other source is a directory.
NAMED_SOURCES = (SAMPLE_SOURCE, SYNTHETIC_SOURCE, SYNTHETIC_SELECT_SOURCE, MIXED_SOURCE, HUB_SOURCE)
_SOURCE_HELP = f"pass --source {', '.join(NAMED_SOURCES)}, or a directory holding {{train,dev,test}}.jsonl and {{train,dev,test}}.tables.jsonl"


def load_split(
    source: str | Path = SAMPLE_SOURCE, split: str = "train", limit: int | None = None
) -> tuple[list[dict], dict[str, dict]]:
    """Load one split: its records and the tables they use.

    Usage::

        >>> records, tables = load_split("sample", "validation")
        >>> records[1]["question"], records[1]["sql"]
        ('How many schools did player number 3 play at?', {'sel': 5, 'conds': [[1, 0, '3']], 'agg': 3})

    :param source: ``"sample"``, ``"hub"`` or a directory in the release layout.
    :param split: one of ``train``, ``validation``, ``test``.
    :param limit: keep only the first ``limit`` questions (``None`` keeps all).
    :raises DataError: unknown source or split, a malformed line, a question whose table is missing.
    :rtype: tuple[list[dict], dict[str, dict]]
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if str(source) == HUB_SOURCE:
        return records_from_hub(_load_hub_split(split), split, limit)
    if str(source) == SYNTHETIC_SOURCE:
        return load_synthetic_split(split, limit)
    if str(source) == SYNTHETIC_SELECT_SOURCE:
        return load_synthetic_split(split, limit, SELECT_ONLY)
    if str(source) == MIXED_SOURCE:
        records, tables = _load_release_split(SAMPLE_DATA_DIR, split, limit)
        synthetic_records, synthetic_tables = load_synthetic_split(split, limit)
        return records + synthetic_records, tables | synthetic_tables
    directory = SAMPLE_DATA_DIR if str(source) == SAMPLE_SOURCE else Path(source).expanduser()
    if not directory.is_dir():
        raise DataError(f"unknown source {str(source)!r} (not a directory); {_SOURCE_HELP}")
    return _load_release_split(directory, split, limit)


def load_records(source: str | Path = SAMPLE_SOURCE, split: str = "train", limit: int | None = None) -> list[dict]:
    """The records of one split (see :func:`load_split`).

    :rtype: list[dict]
    """
    return load_split(source, split, limit)[0]


def source_text(question: str, header: list[str], input_format: str = "schema") -> str:
    """The model's input: the question, with the table's column names unless ``input_format`` is ``question``.

    Usage::

        >>> source_text("How many schools?", ["No.", "School/Club Team"])
        'translate to SQL: How many schools? columns: No. | School/Club Team'
        >>> source_text("How many schools?", ["No.", "School/Club Team"], "uncased")
        'translate to SQL: how many schools? columns: no. | school/club team'

    :param question: the English question.
    :param header: the table's column names.
    :param input_format: ``schema`` (question and columns), ``question`` (the seed's question-only form) or
        ``uncased`` (question and columns in lower case).
    :rtype: str
    """
    if input_format not in INPUT_FORMATS:
        raise DataError(f"unknown input format {input_format!r}; pass --input-format {' or '.join(INPUT_FORMATS)}")
    question = " ".join(question.split())
    if input_format == UNCASED_FORMAT:
        question, header = question.lower(), [name.lower() for name in header]
    text = SQL_TASK_PREFIX + question
    if input_format != "question":
        text += COLUMNS_MARKER + COLUMN_SEPARATOR.join(header)
    return text


def read_source_text(text: str) -> tuple[str, list[str] | None]:
    """The question and header a model input was built from: :func:`source_text` read back.

    Usage::

        >>> read_source_text("translate to SQL: How many schools? columns: No. | School/Club Team")
        ('How many schools?', ['No.', 'School/Club Team'])

    :param text: a model input, e.g. decoded from its token ids.
    :returns: the question, and the column names (``None`` for the ``question`` input format).
    :rtype: tuple[str, list[str] | None]
    """
    question = text.strip().removeprefix(SQL_TASK_PREFIX)
    # The last marker: a question may say "columns:", a header is written after it.
    question, marker, columns = question.rpartition(COLUMNS_MARKER)
    if not marker:
        return columns, None
    return question, columns.split(COLUMN_SEPARATOR)


def target_text(record: dict, input_format: str = "schema") -> str:
    """The model's output for a record: its query as SQL text (:func:`textsql.data.sql.render_sql`), in lower
    case for the ``uncased`` input format.

    :rtype: str
    """
    text = render_sql(record["sql"], record["header"])
    return text.lower() if input_format == UNCASED_FORMAT else text


def cased_sql(text: str, question: str, header: list[str]) -> str:
    """A query the ``uncased`` input format wrote, in the header's case, with each value as the question writes it.

    Usage::

        >>> cased_sql("select count no. from table where player = john smith", "Which No. had John Smith?", ["Player", "No."])
        'SELECT COUNT No. FROM table WHERE Player = John Smith'

    :param text: the model's lower-case query; returned as it is when it does not read as a query over ``header``.
    :rtype: str
    """
    try:
        query = parse_sql(text, header)
    except SQLParseError:
        return text
    question = " ".join(question.split())
    folded = question.lower()
    # Lowercasing keeps positions only when it keeps the length.
    if len(folded) == len(question):
        for condition in query["conds"]:
            start = folded.find(condition[2].lower())
            if condition[2] and start >= 0:
                condition[2] = question[start : start + len(condition[2])]
    return render_sql(query, header)


def recorded_input_format(directory: str | Path) -> str:
    """The input format recorded in a prepared dataset's or model directory's ``prepare.json``, else ``schema``.

    :rtype: str
    """
    record = Path(directory) / PREPARE_JSON_NAME
    if record.is_file():
        return str(read_json(record).get("input_format", INPUT_FORMATS[0]))
    return INPUT_FORMATS[0]


def records_from_hub(rows: Iterable[dict], split: str, limit: int | None = None) -> tuple[list[dict], dict[str, dict]]:
    """Normalise rows in the hub's schema (``table{...}``, ``sql{human_readable, sel, agg, conds{column_index,
    operator_index, condition}}``) to records and tables.

    :param rows: the rows of one split, e.g. a ``datasets.Dataset``.
    :param split: the split name, used in record ids.
    :param limit: keep only the first ``limit`` rows.
    :rtype: tuple[list[dict], dict[str, dict]]
    """
    records: list[dict] = []
    tables: dict[str, dict] = {}
    for index, row in enumerate(rows):
        if limit is not None and index >= limit:
            break
        where = f"{HUB_DATASET} {split} row {index}"
        table, sql = row["table"], row["sql"]
        tables.setdefault(table["id"], checked_table(dict(table), where))
        conds = sql["conds"]
        # datasets gives a Sequence of dicts as a dict of lists; accept a list of dicts as well.
        if isinstance(conds, dict):
            conds = [dict(zip(conds, values)) for values in zip(*conds.values())]
        triples = [[cond["column_index"], cond["operator_index"], cond["condition"]] for cond in conds]
        records.append(
            _record(
                split,
                index,
                row["question"],
                tables[table["id"]],
                {"sel": sql["sel"], "agg": sql["agg"], "conds": triples},
                where,
            )
        )
    return records, tables


def _load_hub_split(split: str) -> Any:
    import datasets

    try:
        return datasets.load_dataset(HUB_DATASET, revision=HUB_REVISION, split=split)
    except (OSError, ValueError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DataError(
            f"cannot load {HUB_DATASET!r} at revision {HUB_REVISION!r} from the hub ({first_line}); "
            f"on a machine without the hub pass --source {SAMPLE_SOURCE} or a directory with the release files"
        ) from None


def _load_release_split(directory: Path, split: str, limit: int | None) -> tuple[list[dict], dict[str, dict]]:
    stem = RELEASE_SPLIT_FILES[split]
    questions_path, tables_path = directory / f"{stem}.jsonl", directory / f"{stem}{TABLES_SUFFIX}"
    for path in (questions_path, tables_path):
        if not path.is_file():
            raise DataError(f"{str(path)!r} is missing; {_SOURCE_HELP}")
    all_tables = load_tables(tables_path)
    records, tables = [], {}
    for index, (where, line) in enumerate(islice(read_jsonl_located(questions_path), limit)):
        if not {"table_id", "question", "sql"} <= line.keys():
            raise DataError(f"{where}: a question needs table_id, question and sql; fix or remove the line")
        table = all_tables.get(line["table_id"])
        if table is None:
            raise DataError(
                f"{where}: table {line['table_id']!r} is not in {str(tables_path)!r}; add the table there or remove the question"
            )
        tables[table["id"]] = table
        records.append(_record(split, index, line["question"], table, line["sql"], where))
    return records, tables


def _record(split: str, index: int, question: Any, table: dict, sql: Any, where: str) -> dict:
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: the question is empty or not text; fix or remove the line")
    return {
        "id": f"{split}-{index}",
        "table_id": table["id"],
        "question": question,
        "header": table["header"],
        "types": table["types"],
        "rows": table["rows"],
        "sql": _checked_sql(sql, len(table["header"]), where),
    }


def _index(value: Any) -> int:
    # int("3") and int(True) would pass; a malformed row must not.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _checked_sql(sql: Any, columns: int, where: str) -> dict:
    """The query as ``{sel, agg, conds}`` with its indices checked against the table's width."""
    try:
        sel, agg, conds = (
            _index(sql["sel"]),
            _index(sql["agg"]),
            [[_index(col), _index(op), value] for col, op, value in sql["conds"]],
        )
    except (KeyError, TypeError, ValueError):
        raise DataError(
            f'{where}: sql must be {{"sel": int, "agg": int, "conds": [[col, op, value], ...]}}; fix the line'
        ) from None
    if not 0 <= sel < columns or not all(0 <= col < columns for col, _, _ in conds):
        raise DataError(
            f"{where}: sql refers to a column outside its table's {columns} columns; fix the line or the table's header"
        )
    if not 0 <= agg < len(AGG_OPS) or not all(0 <= op < len(COND_OPS) for _, op, _ in conds):
        raise DataError(
            f"{where}: sql has an aggregation outside 0..{len(AGG_OPS) - 1} or an operator outside 0..{len(COND_OPS) - 1}; fix the line"
        )
    return {"sel": sel, "conds": conds, "agg": agg}
