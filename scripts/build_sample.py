"""Build the shipped WikiSQL sample (textsql/assets/wikisql_sample) from ../shared/data/wikisql.

The sample is real WikiSQL in the original release layout: {train,dev,test}.jsonl (one question a
line: phase, table_id, question, sql) and {train,dev,test}.tables.jsonl (id, header, types, rows).

Sources (../shared/data/README.md):
- with_headers/{train,valid,test}.jsonl: the first 1,000 train / 100 dev / 100 test questions with
  their full headers (joined with ", ") and gold SQL written with column names, text values quoted.
- original/{dev,test}.jsonl: the release's structured queries, line-aligned with valid/test above.

What is recovered and how:
- Headers: column names may contain ", ", so the header is the split of the columns line into
  ", "-joined groups that contains every column the questions of that table name (read from their
  gold SQL) and, for dev/test, puts each one at the index the release's query gives it.
- Structured sql: dev/test take the release's query and check it against the gold SQL text; train
  reads the gold SQL with the header (a quoted value is a JSON string, a bare one a number, which
  is the convention the dev/test lines confirm).
- Types: "real" for a column compared with a number or aggregated with MAX/MIN/SUM/AVG in some
  question (for dev/test, any release question on that table), else "text" (the columns line says
  nothing about types).
- Rows are not in the sources, so they stay empty (execution accuracy needs the full release).

Usage::

    .venv/bin/python scripts/build_sample.py [--shared ../shared/data/wikisql] [--out textsql/assets/wikisql_sample]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

from textsql.constants import AGG_OPS, SAMPLE_DATA_DIR
from textsql.data.sql import parse_sql
from textsql.errors import DataError, SQLParseError

logger = logging.getLogger(__name__)

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_SHARED = PROJECT_DIR.parent / "shared" / "data" / "wikisql"
# Release split stem -> (with_headers file, original file aligned with it or None).
SPLIT_SOURCES = {
    "train": ("train.jsonl", None),
    "dev": ("valid.jsonl", "dev.jsonl"),
    "test": ("test.jsonl", "test.jsonl"),
}
NUMERIC_AGGREGATIONS = {AGG_OPS.index(name) for name in ("MAX", "MIN", "SUM", "AVG")}
LICENSES = {"original/LICENSE": "LICENSE.WikiSQL", "with_headers/LICENSE": "LICENSE.mlx-examples"}
NOTICE = """\
WikiSQL sample shipped with textsql
===================================

This folder holds a small real sample of WikiSQL in the original release layout:
{counts}.
{{split}}.jsonl: one question a line (table_id, question, sql = {{sel, agg, conds}}; phase where known).
{{split}}.tables.jsonl: one table a line (id, header, types, rows). Rows are empty: cell values are not
in the sources below, so execution accuracy needs the full release (textsql prepare --source DIR or hub).

Sources and licences
- WikiSQL v1.1 (Zhong, Xiong and Socher, 2017), https://github.com/salesforce/WikiSQL,
  BSD 3-Clause licence, Copyright (c) 2017, Salesforce Research: see LICENSE.WikiSQL.
  The dev and test questions and their structured queries are the first 100 lines of the
  release's dev.jsonl and test.jsonl, unchanged.
- The questions with their table headers and gold SQL text come from ml-explore/mlx-examples,
  lora/data (derived from WikiSQL), MIT licence, Copyright (c) 2023 Apple Inc.: see LICENSE.mlx-examples.
  The train questions are the first 1,000 of WikiSQL train as given there; their structured queries
  were read back from that SQL text against the header.

Derived here (scripts/build_sample.py regenerates this folder from those files):
- headers: recovered from the ", "-joined column lists by matching the columns each question's SQL
  names (column names can contain ", ");
- types: "real" where some question compares the column with a number or takes its MAX/MIN/SUM/AVG
  (for dev/test, any question of the release on that table), otherwise "text" (a guess where no
  question says; the release's tables have the true types).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shared", type=Path, default=DEFAULT_SHARED, help="the shared wikisql folder (original/, with_headers/)"
    )
    parser.add_argument("--out", type=Path, default=SAMPLE_DATA_DIR, help="the sample folder to (re)write")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    build(args.shared, args.out)


def build(shared: Path, out: Path) -> dict[str, int]:
    """Write the sample folder from the shared files; return the question count of each split."""
    splits = {stem: read_split(shared, stem) for stem in SPLIT_SOURCES}
    counts = {}
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as temporary:
        staging = Path(temporary) / out.name
        staging.mkdir()
        for stem, questions in splits.items():
            tables = build_tables(questions)
            for question in questions:
                question["sql"] = structured_query(question, tables[question["table_id"]]["header"])
            evidence = release_queries(shared, stem, set(tables)) or [(q["table_id"], q["sql"]) for q in questions]
            for table in tables.values():
                table["types"] = infer_types(
                    table["header"], [sql for table_id, sql in evidence if table_id == table["id"]]
                )
            write_jsonl(staging / f"{stem}.jsonl", [release_line(question) for question in questions])
            write_jsonl(staging / f"{stem}.tables.jsonl", list(tables.values()))
            counts[stem] = len(questions)
            logger.info("%s: %d questions, %d tables", stem, len(questions), len(tables))
        for source, name in LICENSES.items():
            shutil.copyfile(shared / source, staging / name)
        described = ", ".join(f"{counts[stem]:,} {stem} questions" for stem in SPLIT_SOURCES)
        (staging / "NOTICE").write_text(NOTICE.format(counts=described))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return counts


def read_split(shared: Path, stem: str) -> list[dict]:
    """The questions of one split: table id, column list, question, gold SQL text, release query if any."""
    headers_file, original_file = SPLIT_SOURCES[stem]
    path = shared / "with_headers" / headers_file
    questions = []
    for line_number, line in enumerate(path.read_text().splitlines(), 1):
        table_line, columns_line, question_line, answer_line = json.loads(line)["text"].split("\n")
        table_id = table_line.removeprefix("table: ")
        gold = answer_line.removeprefix("A: ").replace(f" FROM {table_id}", " FROM table", 1)
        questions.append(
            {
                "where": f"{path}:{line_number}",
                "table_id": table_id,
                "pieces": columns_line.removeprefix("columns: ").split(", "),
                "question": question_line.removeprefix("Q: "),
                "gold": gold,
                "original": None,
            }
        )
    if original_file:
        with open(shared / "original" / original_file) as lines:
            for question, line in zip(questions, lines):
                original = json.loads(line)
                if (original["table_id"], original["question"]) != (question["table_id"], question["question"]):
                    raise DataError(f"{question['where']}: not aligned with {original_file}; check the shared files")
                question["original"] = original
    return questions


def release_queries(shared: Path, stem: str, table_ids: set[str]) -> list[tuple[str, dict]]:
    """(table id, query) of every release question on these tables (more evidence for types than the sample's)."""
    original_file = SPLIT_SOURCES[stem][1]
    if original_file is None:
        return []
    with open(shared / "original" / original_file) as lines:
        queries = [(line["table_id"], line["sql"]) for line in map(json.loads, lines)]
    return [(table_id, sql) for table_id, sql in queries if table_id in table_ids]


def spans(pieces: list[str]) -> list[str]:
    """Every ", "-joined run of consecutive pieces: the names a column could have."""
    return [", ".join(pieces[start:end]) for start in range(len(pieces)) for end in range(start + 1, len(pieces) + 1)]


def mentioned_columns(question: dict) -> list[tuple[int | None, str]]:
    """(index if the release query gives it, name) of each column the gold SQL names."""
    candidates = spans(question["pieces"])
    read = parse_sql(question["gold"], candidates)
    names = [candidates[read["sel"]]] + [candidates[col] for col, _, _ in read["conds"]]
    original = question["original"]
    if original is None:
        return [(None, name) for name in names]
    indices = [original["sql"]["sel"]] + [col for col, _, _ in original["sql"]["conds"]]
    return list(zip(indices, names))


def build_tables(questions: list[dict]) -> dict[str, dict]:
    """One table per table id, in order of first appearance, with its recovered header."""
    by_table: dict[str, list[dict]] = {}
    for question in questions:
        by_table.setdefault(question["table_id"], []).append(question)
    tables = {}
    for table_id, group in by_table.items():
        pieces = group[0]["pieces"]
        if any(question["pieces"] != pieces for question in group):
            raise DataError(f"{group[0]['where']}: table {table_id!r} has different column lists across questions")
        mentions = [mention for question in group for mention in mentioned_columns(question)]
        header = recover_header(pieces, mentions)
        if header is None:
            raise DataError(
                f"{group[0]['where']}: no split of {', '.join(pieces)!r} fits the columns its questions name: {mentions!r}"
            )
        tables[table_id] = {"id": table_id, "header": header, "types": [], "rows": []}
    return tables


def recover_header(pieces: list[str], mentions: list[tuple[int | None, str]]) -> list[str] | None:
    """Group the pieces into column names so that every mentioned name is a column (at its index).

    Pieces stay separate unless a mentioned name spans them, or an index from the release
    needs an unmentioned comma-joined name before it (tried last).
    """
    names = {name for _, name in mentions}
    at_index = {index: name for index, name in mentions if index is not None}

    def groups(start: int, header: list[str]) -> list[str] | None:
        if start == len(pieces):
            return (
                header
                if names <= set(header) and all(i < len(header) and header[i] == n for i, n in at_index.items())
                else None
            )
        index = len(header)
        lengths = range(1, len(pieces) - start + 1)
        # Mentioned names first, then single pieces, then any other join (only an index can ask for it).
        ordered = sorted(lengths, key=lambda n: (", ".join(pieces[start : start + n]) not in names, n != 1, n))
        for length in ordered:
            name = ", ".join(pieces[start : start + length])
            if index in at_index and at_index[index] != name:
                continue
            if length > 1 and name not in names and not at_index:
                continue
            found = groups(start + length, header + [name])
            if found is not None:
                return found
        return None

    return groups(0, [])


def structured_query(question: dict, header: list[str]) -> dict:
    """The question's {sel, agg, conds}: the release's where given (checked), else read from the gold SQL."""
    read = parse_sql(question["gold"], header)
    conds = [[col, op, gold_value(value, question["where"])] for col, op, value in read["conds"]]
    recovered = {"sel": read["sel"], "conds": conds, "agg": read["agg"]}
    original = question["original"]
    if original is not None and _typed(original["sql"]) != _typed(recovered):
        raise DataError(f"{question['where']}: gold SQL reads as {recovered!r}, the release has {original['sql']!r}")
    return original["sql"] if original is not None else recovered


def _typed(sql: dict) -> tuple:
    return sql["sel"], sql["agg"], [(col, op, type(value).__name__, value) for col, op, value in sql["conds"]]


def gold_value(text: str, where: str) -> str | int | float:
    """A value as the gold SQL writes it: 'quoted' is a string, bare is a number."""
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1]
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    raise SQLParseError(f"{where}: value {text!r} is neither quoted nor a number")


def infer_types(header: list[str], queries: list[dict]) -> list[str]:
    """'real' for columns some query compares with a number or aggregates numerically, else 'text'."""
    real = {sql["sel"] for sql in queries if sql["agg"] in NUMERIC_AGGREGATIONS}
    real |= {col for sql in queries for col, _, value in sql["conds"] if isinstance(value, (int, float))}
    return ["real" if index in real else "text" for index in range(len(header))]


def release_line(question: dict) -> dict:
    """A question in the release's line form (phase only where the release gives it)."""
    original = question["original"] or {}
    line = {"phase": original["phase"]} if "phase" in original else {}
    line.update({"table_id": question["table_id"], "question": question["question"], "sql": question["sql"]})
    return line


def write_jsonl(path: Path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


if __name__ == "__main__":
    main()
