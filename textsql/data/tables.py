"""WikiSQL's tables files (``*.tables.jsonl``), where a prepared dataset keeps them, and the check that a directory
holds a prepared dataset at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from textsql.errors import DataError
from textsql.json_files import read_jsonl_located

# Where a prepared dataset keeps its splits' tables.
TABLES_DIR_NAME = "tables"
# The release layout keeps each question file's tables beside it: dev.jsonl, dev.tables.jsonl.
TABLES_SUFFIX = ".tables.jsonl"
# What datasets' save_to_disk writes beside the splits of a DatasetDict: their names.
DATASET_DICT_FILE = "dataset_dict.json"


def load_tables(path: str | Path) -> dict[str, dict]:
    """Read a release ``*.tables.jsonl`` file into ``{table_id: table}``, each checked by :func:`checked_table`.

    Usage::

        >>> from textsql.constants import SAMPLE_DATA_DIR
        >>> load_tables(SAMPLE_DATA_DIR / "dev.tables.jsonl")["1-10015132-11"]["header"][:2]
        ['Player', 'No.']

    :param path: the tables file.
    :rtype: dict[str, dict]
    :raises DataError: for a missing file, a bad line, or a table without id or header.
    """
    tables = {}
    for where, line in read_jsonl_located(path):
        table = checked_table(line, where)
        tables[table["id"]] = table
    return tables


def checked_table(table: Any, where: str) -> dict:
    """A table in the release form, with types (default text) and rows (default empty) filled in.

    :param table: one table as read (a release line or a hub row's ``table``); completed in place.
    :param where: where it came from, for the error message (``file:line``).
    :rtype: dict
    :raises DataError: without an id and a header, or when its types do not match its columns.
    """
    header = table.get("header") if isinstance(table, dict) else None
    if (
        not isinstance(header, list)
        or not all(isinstance(name, str) for name in header)
        or not isinstance(table.get("id"), str)
    ):
        raise DataError(f"{where}: a table needs an id and a header (a list of column names); fix or remove the line")
    table["types"] = list(table.get("types") or ["text"] * len(header))
    table["rows"] = list(table.get("rows") or [])
    if len(table["types"]) != len(header):
        raise DataError(
            f"{where}: table {table['id']!r} has {len(header)} columns but {len(table['types'])} types; fix its types"
        )
    return table


def tables_beside(questions: str | Path) -> Path | None:
    """The tables file the release layout keeps beside a question file (``dev.jsonl``: ``dev.tables.jsonl``), when present.

    :param questions: a question file.
    :rtype: pathlib.Path | None
    """
    path = Path(questions)
    candidate = path.with_name(path.name.removesuffix(".jsonl") + TABLES_SUFFIX)
    return candidate if path.suffix == ".jsonl" and candidate.is_file() else None


def prepared_tables_path(data_dir: str | Path, split: str) -> Path:
    """Where ``textsql prepare`` keeps a split's tables in its output directory.

    :param data_dir: the prepared dataset's directory.
    :param split: ``train``, ``validation`` or ``test``.
    :rtype: pathlib.Path
    """
    return Path(data_dir) / TABLES_DIR_NAME / f"{split}{TABLES_SUFFIX}"


def check_prepared(data_dir: str | Path) -> None:
    """Refuse, in milliseconds and before any worker starts, a directory that holds no prepared train split.

    Only the split list ``save_to_disk`` wrote is read; the ranks load the data themselves.

    :param data_dir: what training will read (``--data_dir``, notebook 02's ``data_dir``).
    :raises DataError: naming the step that writes one.
    """
    fix = "run notebook 01 or `textsql prepare --data-dir DIR` first and pass that DIR as data_dir (--data-dir)"
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise DataError(f"no prepared dataset at {str(data_dir)!r} (no such directory); {fix}")
    try:
        splits = json.loads((path / DATASET_DICT_FILE).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"{str(data_dir)!r} is not a prepared dataset (no readable {DATASET_DICT_FILE}); {fix}"
        ) from None
    if "train" not in splits:
        raise DataError(f"prepared dataset {str(data_dir)!r} has no train split; {fix}")
