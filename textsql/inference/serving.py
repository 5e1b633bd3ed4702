"""One question answered as a served model answers it (the CML Model, ``cml/model.py:predict``).

A request ``{"question": str, "header": [str, ...], "rows": [[cell, ...], ...] optional, "types": [...] optional}``
is checked against the limits below, the trained model writes the query with constrained decoding
(:meth:`textsql.inference.predictor.Predictor.ask`), and with rows the query runs over them in SQLite through
WikiSQL's own engine (:class:`textsql.scoring.engine.TableEngine`), which gives ``"answer"``. Whatever goes
wrong, the caller gets ``{"error": "<one line naming the fix>"}``, never an exception: a served function's
traceback reaches nobody.

The model is loaded once per process, on the first request (:func:`served_predictor`), from
``TEXTSQL_MODEL_DIR``, else ``$TEXTSQL_RUN_DIR/model`` (the AMP's training run), relative paths from the project
root; a request before the model exists is answered with that error, and a later one loads it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from textsql.constants import MODEL_SUBDIR, PROJECT_DIR
from textsql.errors import DataError, ModelError, TextSQLError
from textsql.inference.predictor import Predictor
from textsql.model import has_weights
from textsql.scoring.engine import ExecutionError, TableEngine

logger = logging.getLogger(__name__)

MODEL_DIR_VAR = "TEXTSQL_MODEL_DIR"
RUN_DIR_VAR = "TEXTSQL_RUN_DIR"
# What one request may hold: a question a person writes, a WikiSQL-sized table (its largest have 44 columns),
# and rows small enough to execute in milliseconds.
MAX_QUESTION_CHARS = 500
MAX_COLUMNS = 64
MAX_NAME_CHARS = 200
MAX_ROWS = 1000
MAX_CELL_CHARS = 1000
FIELDS = ("question", "header", "rows", "types")
COLUMN_TYPES = ("text", "real")
EXAMPLE = '{"question": "How many players are from Spain?", "header": ["Player", "Country"]}'

_loaded: dict[Path, Predictor] = {}
_loading = threading.Lock()


def served_model_dir(environ: Mapping[str, str] | None = None, root: Path = PROJECT_DIR) -> Path:
    """The model directory a served model loads: ``TEXTSQL_MODEL_DIR``, else ``$TEXTSQL_RUN_DIR/model``.

    :raises ModelError: when neither variable is set.
    :rtype: pathlib.Path
    """
    environ = os.environ if environ is None else environ
    if environ.get(MODEL_DIR_VAR):
        chosen = Path(environ[MODEL_DIR_VAR])
    elif environ.get(RUN_DIR_VAR):
        chosen = Path(environ[RUN_DIR_VAR]) / MODEL_SUBDIR
    else:
        raise ModelError(f"no model to serve: set {MODEL_DIR_VAR} to a trained model/ or {RUN_DIR_VAR} to its run")
    return chosen.expanduser() if chosen.expanduser().is_absolute() else root / chosen


def served_predictor(model_dir: Path) -> Predictor:
    """The predictor of ``model_dir``, loaded on the first call and kept for the process's life.

    :raises ModelError: when the directory holds no trained weights (nothing is kept, so a later call retries).
    :rtype: Predictor
    """
    with _loading:
        if model_dir not in _loaded:
            if not has_weights(model_dir):
                raise ModelError(
                    f"no trained model in {str(model_dir)!r}; run the training job first, or set {MODEL_DIR_VAR}"
                )
            _loaded[model_dir] = Predictor.load(model_dir)
            logger.info("serving %s on %s", model_dir, _loaded[model_dir].device)
        return _loaded[model_dir]


def answer(predictor: Predictor, request: Any) -> dict:
    """The response to one request: ``{"sql", "query"}`` (plus ``"answer"`` with rows), or ``{"error"}``.

    :param predictor: the loaded model.
    :param request: the request's JSON as a dict.
    :rtype: dict
    """
    try:
        question, header, rows, types = checked_request(request)
        written = predictor.ask(question, header)
    except TextSQLError as error:
        return {"error": one_line(str(error))}
    response = {"sql": written["sql"], "query": written["query"]}
    if written["query"] is None:
        return {**response, "error": one_line(f"the model wrote no query over this header: {written['error']}")}
    if rows is not None:
        table = {"header": header, "types": types or column_types(rows, len(header)), "rows": rows}
        try:
            with TableEngine({"request": table}) as engine:
                response["answer"] = engine.execute("request", written["query"])
        except ExecutionError as error:
            return {**response, "error": one_line(f"the query does not run over these rows: {error}")}
    return response


def checked_request(request: Any) -> tuple[str, list[str], list[list] | None, list[str] | None]:
    """The request's question, header, rows and types, each checked against its type and limit.

    :raises DataError: naming the field and what to send instead.
    :rtype: tuple
    """
    if not isinstance(request, dict):
        raise DataError(f"the request must be a JSON object such as {EXAMPLE}, got {type(request).__name__}")
    unknown = sorted(set(request) - set(FIELDS))
    if unknown:
        raise DataError(f"unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    question = request.get("question")
    if not isinstance(question, str) or not question.strip() or len(question) > MAX_QUESTION_CHARS:
        raise DataError(f'"question" must be a non-empty string of at most {MAX_QUESTION_CHARS} characters: {EXAMPLE}')
    header = request.get("header")
    if (
        not isinstance(header, list)
        or not 0 < len(header) <= MAX_COLUMNS
        or not all(isinstance(name, str) and 0 < len(name.strip()) <= MAX_NAME_CHARS for name in header)
    ):
        raise DataError(
            f'"header" must be a list of 1 to {MAX_COLUMNS} column names, each 1 to {MAX_NAME_CHARS} characters: {EXAMPLE}'
        )
    return question, header, _checked_rows(request.get("rows"), len(header)), _checked_types(request, len(header))


def _checked_rows(rows: Any, width: int) -> list[list] | None:
    if rows is None:
        return None
    if not isinstance(rows, list) or len(rows) > MAX_ROWS:
        raise DataError(f'"rows" must be a list of at most {MAX_ROWS} rows, each a list of one cell per column')
    for index, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width:
            raise DataError(f'"rows"[{index}] must be a list of {width} cells, one per column of "header"')
        if not all(_is_cell(cell) for cell in row):
            raise DataError(
                f'"rows"[{index}] holds a cell that is not a string of at most {MAX_CELL_CHARS} characters or a number'
            )
    return rows


def _checked_types(request: dict, width: int) -> list[str] | None:
    types = request.get("types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != width or not all(kind in COLUMN_TYPES for kind in types):
        raise DataError(f'"types" must list "text" or "real" for each of the {width} columns, or be left out')
    return types


def _is_cell(cell: Any) -> bool:
    if isinstance(cell, str):
        return len(cell) <= MAX_CELL_CHARS
    return isinstance(cell, (int, float)) and not isinstance(cell, bool)


def column_types(rows: list[list], width: int) -> list[str]:
    """WikiSQL's column types for rows given without them: ``real`` where every cell is a number, else ``text``.

    :rtype: list[str]
    """
    return ["real" if rows and all(_is_number(row[index]) for row in rows) else "text" for index in range(width)]


def _is_number(cell: Any) -> bool:
    if isinstance(cell, (int, float)):
        return True
    try:
        float(str(cell).replace(",", ""))
    except ValueError:
        return False
    return True


def one_line(text: str) -> str:
    """``text`` on one line (an error message inside a JSON response).

    :rtype: str
    """
    return " ".join(text.split())
