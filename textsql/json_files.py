"""JSON and JSON lines files: read bounded and checked, written atomically.

Reads raise :class:`~textsql.errors.DataError` naming the file (and the line, for JSON lines) and
what to do. Every write goes through :func:`worker.files.atomic_write`, so a reader (TensorBoard, a
notebook, a second rank) sees the old file or the new one, never half of one; the folder is created.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from textsql.errors import DataError
from worker.files import UnsafeRead, atomic_write, read_bounded

# The largest JSON file read: a run's records (run.json with its log history, metrics.json) are far smaller,
# and a worker that wrote a larger one shall not fill the master's memory.
MAX_JSON_BYTES = 64 * 1024**2


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


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text)
