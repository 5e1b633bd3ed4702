"""The library's files: JSON and JSON lines, WikiSQL's tables files, and each run's master-private directory.

Reads raise :class:`~textsql.errors.DataError` naming the file (and the line, for JSON lines) and
what to do. Every write goes through :func:`worker.files.atomic_write`, so a reader (TensorBoard, a
notebook, a second rank) sees the old file or the new one, never half of one; the folder is created.

The module is called ``files``, not ``io``: a script run from inside ``textsql/`` would otherwise
shadow the standard library's ``io`` for the whole interpreter.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from textsql.constants import LAUNCH_HOSTS_NAME, STATE_DIR_VAR, TABLES_DIR_NAME
from textsql.errors import DataError
from worker.files import UnsafePath, UnsafeRead, atomic_write, private_dir, read_bounded

logger = logging.getLogger(__name__)

# The release layout keeps each question file's tables beside it: dev.jsonl, dev.tables.jsonl.
TABLES_SUFFIX = ".tables.jsonl"
# The largest JSON file read: a run's records (run.json with its log history, metrics.json) are far smaller,
# and a worker that wrote a larger one shall not fill the master's memory.
MAX_JSON_BYTES = 64 * 1024**2
# What datasets' save_to_disk writes beside the splits of a DatasetDict: their names.
DATASET_DICT_FILE = "dataset_dict.json"


def master_dir(run_dir: str | Path) -> Path:
    """The run's master-private directory: what the master writes and later trusts, where no worker writes.

    The run directory is shared with the workers on Kubernetes and CML (a project volume) and with hosts that mount
    it over NFS, so the master's own records live apart, 0700, on the master's disk: under ``$TEXTSQL_STATE_DIR``,
    else ``$XDG_STATE_HOME/textsql`` (``~/.local/state/textsql``), one directory per run directory, named after it
    and a hash of its resolved path.

    :param run_dir: the run directory.
    :rtype: pathlib.Path
    :raises UnsafePath: if the directory (or its root) is a link or another user's, or lies inside the run directory.
    """
    run = Path(run_dir).resolve()
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "textsql"
    root = Path(os.environ.get(STATE_DIR_VAR) or state).absolute()
    if root.resolve().is_relative_to(run):
        raise UnsafePath(
            f"{STATE_DIR_VAR}={str(root)!r} lies in the run directory the workers may write; set it elsewhere"
        )
    directory = root / "runs" / f"{run.name}-{hashlib.sha256(str(run).encode()).hexdigest()[:16]}"
    for path in (private_dir(root), private_dir(directory)):
        if path.lstat().st_uid != os.getuid():
            raise UnsafePath(f"{str(path)!r} belongs to another user; set {STATE_DIR_VAR} to a directory of your own")
    return directory


def record_launch_hosts(run_dir: str | Path, hosts: Iterable[str]) -> None:
    """Keep a launch's hosts, in the hostfile's order (rank 0's first; none for the local launcher), in the run's
    master-private directory before its runner starts: the displays believe step lines from the first one only.

    :param run_dir: the run directory.
    :param hosts: the launch's hosts.
    """
    atomic_write(master_dir(run_dir) / LAUNCH_HOSTS_NAME, "".join(f"{host}\n" for host in hosts), mode=0o600)


def launch_hosts(run_dir: str | Path) -> list[str]:
    """The hosts of the run's latest launch, rank 0's first (:func:`record_launch_hosts`); none before its first
    launch and for the local launcher, whose lines carry no host's prefix.

    :param run_dir: the run directory.
    :rtype: list[str]
    """
    path = master_dir(run_dir) / LAUNCH_HOSTS_NAME
    return path.read_text(encoding="utf-8").split() if path.is_file() else []


def read_json(path: str | Path) -> Any:
    """The JSON value in a file; a worker may have written it (a run's records on a shared run directory), so a
    link, anything but a regular file, and more than :data:`MAX_JSON_BYTES` are refused.

    :param path: the file.
    :rtype: Any
    :raises DataError: for a missing, linked, irregular or oversized file, or text that is not JSON.
    """
    path = Path(path)
    try:
        data = read_bounded(path, MAX_JSON_BYTES)
        return json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise DataError(f"{str(path)!r} is not a file; check the path") from None
    except UnsafeRead as error:
        raise DataError(f"{error}; a run's JSON files are regular files this size at most: remove it") from None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise DataError(f"{str(path)!r} is a symbolic link, not followed; remove it") from None
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: {_not_utf8(error)}") from None
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path}:{error.lineno}: not JSON ({error.msg} at column {error.colno}); fix or rewrite the file"
        ) from None


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, atomically.

    :param path: destination; its folder is created.
    :param data: what to write.
    :rtype: pathlib.Path
    """
    return _write(Path(path), json.dumps(data, indent=2) + "\n")


def read_jsonl_located(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield ``("file:line", object)`` for each non-blank line of a JSON-lines file, so that a caller
    checking the objects can say where a bad one is.

    :param path: the file.
    :rtype: Iterator[tuple[str, dict]]
    :raises DataError: for a missing file or a line that is not one JSON object, naming file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{str(path)!r} is not a file; check the path")
    # Bytes, decoded line by line, so that text that is not UTF-8 is reported with its line.
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{where}: {_not_utf8(error)}") from None
            if not text.strip():
                continue
            try:
                item = json.loads(text)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{where}: not a JSON object ({error.msg} at column {error.colno}); fix or remove the line"
                ) from None
            if not isinstance(item, dict):
                raise DataError(f"{where}: a JSON {type(item).__name__}, not an object; fix or remove the line")
            yield where, item


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Yield one dict per non-blank line of a JSON-lines file (see :func:`read_jsonl_located`).

    Usage::

        >>> lines = list(read_jsonl("runs/demo/predictions.jsonl"))    # doctest: +SKIP

    :param path: the file.
    :rtype: Iterator[dict]
    """
    for _, item in read_jsonl_located(path):
        yield item


def _not_utf8(error: UnicodeDecodeError) -> str:
    return f"not UTF-8 (byte {error.object[error.start]:#04x}); re-save the file as UTF-8"


def write_jsonl(path: str | Path, items: Iterable[dict]) -> Path:
    """Write one JSON object per line (non-ASCII text kept readable), atomically.

    :param path: destination; its folder is created.
    :param items: the objects, in order.
    :rtype: pathlib.Path
    """
    return _write(Path(path), "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))


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


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text)


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
