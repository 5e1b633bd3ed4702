"""Synthetic WikiSQL questions (``--source synthetic``): the seeded sampler of their tables, queries and splits.

A T5 from random weights trained on the 1,000 real sample questions memorises their 250 tables instead of
learning to copy a column name (docs/explanation/synthetic-data.md). Synthesised questions vary the column
names and values a model must copy more than it can memorise, as schema-based synthesis does for unseen
databases (GAZP, Zhong et al. 2020; WikiSQL itself started from template questions, later paraphrased).

What the questions are:

- held out: over real headers of the sample's tables (validation: its train tables'; test: those and its dev and
  test tables'), with the sample's column types (``real`` where
  a real question compares or aggregates the column as a number, else ``text``); training: over
  :data:`TRAIN_TABLES` recombined headers whose column names are new sequences of the words of the sample's
  column names;
- WikiSQL's grammar: one selected column, an aggregation that fits its type (``COUNT`` or none on any
  column, ``MAX``/``MIN``/``SUM``/``AVG`` on ``real`` ones), up to :data:`MAX_CONDITIONS` conditions on
  other columns, each column once, ``>`` and ``<`` on ``real`` columns only;
- English from templates (several phrasings of each aggregation, operator and clause order:
  :mod:`textsql.data.synthetic_templates`), with the column names as the header writes them or in lower
  case, and every condition value verbatim;
- over rows: every table gets rows (names, places, teams, dates, scores, numbers, by the column's name
  and type: :mod:`textsql.data.synthetic_cells`), and each question is written from one of its rows, so its
  gold query finds that row (execution accuracy is measured, and execution-guided decoding has rows).

What they are not: WikiSQL's crowd-sourced paraphrases. Template English is far easier than real
questions, so scores on the held-out synthetic tables show that a pipeline learns to read a schema,
not how it would do on WikiSQL.

Splits: no training column name is (case-insensitively) a column name of a validation or test header, or
of the sample's dev and test tables, so held-out and real validation questions ask about columns the model
has not seen, made of words it has. Everything is drawn from :data:`SEED`: the same call gives the same
questions on every machine.
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass

from textsql.constants import AGG_OPS, COND_OPS, RELEASE_SPLIT_FILES, SAMPLE_DATA_DIR, SPLITS
from textsql.data.synthetic_cells import cell_maker
from textsql.data.synthetic_templates import (
    CLAUSE_JOINERS,
    CONDITION_JOINERS,
    CONDITION_PHRASES,
    LEADING_CLAUSE_OPENERS,
    SELECT_PHRASES,
)
from textsql.data.tables import TABLES_SUFFIX, load_tables
from textsql.errors import DataError

logger = logging.getLogger(__name__)

SEED = 28
MAX_CONDITIONS = 4
# Held-out questions per split and how many distinct headers validation uses: the test split is large enough
# that a score's standard error is about 1.5 points (sqrt(0.5 * 0.5 / 1000)); validation stays small because
# training evaluates it repeatedly.
QUESTIONS = {"validation": 200, "test": 1000}
VALIDATION_HEADERS = 15
# The test split's tables (tests/test_synthetic.py checks it): enough that a score is not one table's habits.
TEST_HEADERS = 72
# Training questions and tables: more than the demo's 1,800 steps of 2 x 16 consume (57,600), so none is seen twice
# (a model that sees each of 12,000 five times learns them by heart), four to a table.
TRAIN_QUESTIONS = 64000
TRAIN_TABLES = 16000
# Training tables' column counts (WikiSQL's headers mostly have 4 to 8), and how many columns are numbers.
TRAIN_COLUMNS = (4, 8)
REAL_SHARE = 0.35
ROWS_PER_TABLE = 12
# How often a held-out query has 0..4 conditions (WikiSQL: almost all have one or two), and a training one: more
# often three or four, since a model that rarely sees a long WHERE clause learns to stop after two conditions
# (docs/explanation/training-defaults.md).
CONDITION_WEIGHTS = (2, 60, 28, 7, 3)
TRAINING_CONDITION_WEIGHTS = (2, 35, 33, 20, 10)


@dataclass(frozen=True)
class Synthesis:
    """One synthetic source: its name (the records' id prefix), its training questions and tables, their column
    counts, and how often a held-out query and a training one have 0..4 conditions."""

    name: str = "synthetic"
    training_questions: int = TRAIN_QUESTIONS
    training_tables: int = TRAIN_TABLES
    columns: tuple[int, int] = TRAIN_COLUMNS
    condition_weights: tuple[int, ...] = CONDITION_WEIGHTS
    training_condition_weights: tuple[int, ...] = TRAINING_CONDITION_WEIGHTS

    def questions(self, split: str) -> int:
        """How many questions ``split`` holds."""
        return self.training_questions if split == "train" else QUESTIONS[split]


FULL = Synthesis()
# The learning check's source (``synthetic-select``): 12,000 questions without conditions over 3,000 four-column
# training tables, so a model from random weights learns within minutes to copy the column a question names
# (docs/explanation/learning-check.md calibrated it so); held out as FULL's.
SELECT_ONLY = Synthesis(
    name="synthetic-select",
    training_questions=12000,
    training_tables=3000,
    columns=(4, 4),
    condition_weights=(1, 0, 0, 0, 0),
    training_condition_weights=(1, 0, 0, 0, 0),
)

_AGG = {name: index for index, name in enumerate(AGG_OPS)}
_OP = {name: index for index, name in enumerate(COND_OPS)}


def load_synthetic_split(
    split: str = "train", limit: int | None = None, synthesis: Synthesis = FULL
) -> tuple[list[dict], dict[str, dict]]:
    """Synthesised questions of one split, as records, and their tables in the release form (with rows).

    Usage::

        >>> records, tables = load_synthetic_split("validation", limit=1)
        >>> sorted(records[0]) == ["header", "id", "question", "rows", "sql", "table_id", "types"]
        True

    :param split: one of ``train``, ``validation``, ``test``.
    :param limit: keep only the first ``limit`` questions (``None`` keeps all).
    :param synthesis: :data:`FULL` (``--source synthetic``) or :data:`SELECT_ONLY` (``synthetic-select``).
    :rtype: tuple[list[dict], dict[str, dict]]
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    rng = random.Random(f"{SEED}-{split}")
    headers = split_headers(synthesis)[split]
    tables = {}
    for number, (header, types) in enumerate(headers):
        table_id = f"{synthesis.name}-{split}-{number}"
        tables[table_id] = _table(table_id, header, types, rng)
    table_list = list(tables.values())
    count = synthesis.questions(split) if limit is None else min(limit, synthesis.questions(split))
    weights = synthesis.training_condition_weights if split == "train" else synthesis.condition_weights
    records = []
    for index in range(count):
        table = table_list[index % len(table_list)]
        question, sql = _question(table, rng, weights)
        records.append(
            {
                "id": f"{synthesis.name}-{split}-{index}",
                "table_id": table["id"],
                "question": question,
                "header": table["header"],
                "types": table["types"],
                "rows": table["rows"],
                "sql": sql,
            }
        )
    used = {record["table_id"] for record in records}
    return records, {table_id: table for table_id, table in tables.items() if table_id in used}


# Computed once a process: each split's load needs them, and the training tables take half a second.
@functools.cache
def split_headers(synthesis: Synthesis = FULL) -> dict[str, list[tuple[list[str], list[str]]]]:
    """The ``(header, types)`` of the tables each split synthesises questions over.

    Validation takes :data:`VALIDATION_HEADERS` real headers and test all the other eligible ones (about two
    dozen) from the sample's train tables and those of the sample's dev and test tables (:data:`TEST_HEADERS` in
    all), drawn from :data:`SEED`, with the sample's column types (``real`` where any sample table with that header
    says so).
    Training takes the source's ``training_tables`` recombined headers (:func:`_recombined_headers`): column names
    written from the words of the sample's column names, none of which (case-insensitively) is a held-out column
    name or a column name of the sample's dev and test tables, so held-out and real validation columns are unseen.
    The same object is returned to every caller: read it, do not change it.

    :rtype: dict[str, list[tuple[list[str], list[str]]]]
    """
    types: dict[tuple[str, ...], list[str]] = {}
    unseen: set[str] = set()
    real_held_out: set[tuple[str, ...]] = set()
    for split, stem in RELEASE_SPLIT_FILES.items():
        for table in load_tables(SAMPLE_DATA_DIR / f"{stem}{TABLES_SUFFIX}").values():
            header = tuple(table["header"])
            known = types.setdefault(header, list(table["types"]))
            types[header] = ["real" if "real" in pair else "text" for pair in zip(known, table["types"])]
            if split != "train":
                unseen.update(name.lower() for name in header)
                real_held_out.add(header)
    rng = random.Random(SEED)

    def askable(header: tuple[str, ...]) -> bool:
        # A query names a column by its name, so a header naming two columns alike cannot be asked about both.
        return len({name.lower() for name in header}) == len(header)

    candidates = sorted(
        header for header in types if askable(header) and not {name.lower() for name in header} & unseen
    )
    # The sample's train tables hold only a few dozen such headers: validation takes VALIDATION_HEADERS, test the
    # others and the headers of the sample's dev and test tables, whose names training never has either (drawn
    # apart, so training and validation stay as they were): over TEST_HEADERS tables, not one table's habits.
    chosen = rng.sample(candidates, len(candidates))
    real = sorted(header for header in real_held_out if askable(header) and header not in chosen)
    held_out = {
        "validation": chosen[:VALIDATION_HEADERS],
        "test": chosen[VALIDATION_HEADERS:] + random.Random(f"{SEED}-test-headers").sample(real, len(real)),
    }
    unseen.update(name.lower() for headers in held_out.values() for header in headers for name in header)
    # Words, not fragments such as "(2008)" or "[e": names a question can say, as WikiSQL's columns mostly are.
    words = sorted(
        {word for header in types for name in header for word in name.split() if word.isalpha() and len(word) > 1}
    )
    return {
        "train": _recombined_headers(words, unseen, rng, synthesis.training_tables, synthesis.columns),
        **{split: [(list(header), types[header]) for header in headers] for split, headers in held_out.items()},
    }


def _recombined_headers(
    words: list[str], unseen: set[str], rng: random.Random, tables: int, column_counts: tuple[int, int]
) -> list[tuple[list[str], list[str]]]:
    """``tables`` headers of new column names, each a few of ``words`` in a row, none in ``unseen``.

    Far more column names than a small model can memorise, written from the same words as real headers: the
    model learns to copy the name a question mentions rather than to recall the names of the tables it saw.
    """
    headers: list[tuple[list[str], list[str]]] = []
    while len(headers) < tables:
        names: list[str] = []
        taken = set(unseen)
        columns = rng.randint(*column_counts)
        while len(names) < columns:
            name = " ".join(rng.sample(words, rng.choices((1, 2, 3), (4, 4, 2))[0]))
            if name.lower() not in taken:
                taken.add(name.lower())
                names.append(name)
        headers.append((names, ["real" if rng.random() < REAL_SHARE else "text" for _ in names]))
    return headers


def _table(table_id: str, header: list[str], types: list[str], rng: random.Random) -> dict:
    """A table with this header and rows drawn for each column."""
    makers = [cell_maker(name, kind) for name, kind in zip(header, types)]
    rows = [[make(rng) for make in makers] for _ in range(ROWS_PER_TABLE)]
    return {"id": table_id, "header": header, "types": types, "rows": rows}


def _question(table: dict, rng: random.Random, condition_weights: tuple[int, ...]) -> tuple[str, dict]:
    """One question and its gold query, written from one row of ``table`` so the query finds that row."""
    header, types, row = table["header"], table["types"], rng.choice(table["rows"])
    columns = list(range(len(header)))
    sel = rng.choice(columns)
    agg = _aggregation(types[sel], rng)
    others = [column for column in columns if column != sel]
    count = min(rng.choices(range(MAX_CONDITIONS + 1), condition_weights)[0], len(others))
    conds, phrases = [], []
    for column in rng.sample(others, count):
        op = rng.choice(("=", ">", "<")) if types[column] == "real" and rng.random() < 0.5 else "="
        value = _condition_value(row[column], op, rng)
        conds.append([column, _OP[op], value])
        phrases.append(rng.choice(CONDITION_PHRASES[op]).format(col=_named(header[column], rng), value=value))
    select = rng.choice(SELECT_PHRASES[agg]).format(col=_named(header[sel], rng))
    if not phrases:
        question = f"{select}?"
    elif rng.random() < 0.25:
        question = f"{rng.choice(LEADING_CLAUSE_OPENERS)} {rng.choice(CONDITION_JOINERS).join(phrases)}, {select[0].lower()}{select[1:]}?"
    else:
        question = f"{select} {rng.choice(CLAUSE_JOINERS)} {rng.choice(CONDITION_JOINERS).join(phrases)}?"
    return question, {"sel": sel, "agg": _AGG[agg], "conds": conds}


def _aggregation(kind: str, rng: random.Random) -> str:
    if kind == "real":
        return rng.choices(("", "COUNT", "MAX", "MIN", "SUM", "AVG"), (40, 12, 12, 12, 12, 12))[0]
    return rng.choices(("", "COUNT"), (85, 15))[0]


def _named(name: str, rng: random.Random) -> str:
    # WikiSQL's questions name a column as the header writes it or in lower case.
    return name if rng.random() < 0.5 else name.lower()


def _condition_value(cell: str | float, op: str, rng: random.Random) -> str:
    """The value a condition on ``cell``'s column compares with, as the question writes it: the cell
    itself for ``=``, a number below it for ``>`` and above it for ``<`` (so the row matches)."""
    if op == "=":
        return str(cell)
    step = rng.randint(1, 5)
    return str(int(cell) - step if op == ">" else int(cell) + step)
