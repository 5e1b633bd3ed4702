"""Tokenize WikiSQL for T5 and save it where training and inference read it (``textsql prepare``).

The output directory holds a ``datasets.DatasetDict`` (``save_to_disk``) with the splits train,
validation and test and the columns id, table_id, question, header, sql (JSON), target (SQL text),
source_text (model input), input_ids, attention_mask and labels, unpadded: batches are padded at
train time by ``transformers.DataCollatorForSeq2Seq(label_pad_token_id=-100)``. Beside it,
``prepare.json`` records the source, counts, token length percentiles, truncation counts, tokenizer
and input format, and ``tables/{split}.tables.jsonl`` the tables in the release form (for execution
accuracy). Everything is written to a temporary directory beside ``--data-dir`` and renamed into place,
so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy
from datasets import Dataset, DatasetDict, Features, List, Value
from tokenizers import Tokenizer

from textsql.arguments import PrepareArguments
from textsql.console import counted
from textsql.constants import PREPARE_JSON_NAME, SPLITS
from textsql.data.tables import prepared_tables_path
from textsql.data.wikisql import NAMED_SOURCES, load_split, source_text, target_text
from textsql.errors import DataError
from textsql.json_files import write_json, write_jsonl
from textsql.model import load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 95, 99)
# The option that names the tokenizer in `textsql prepare` (the field and notebook 01's parameter are `model`).
TOKENIZER_FLAG = "--tokenizer"
TEXT_FEATURES = Features(
    {
        "id": Value("string"),
        "table_id": Value("string"),
        "question": Value("string"),
        "header": List(Value("string")),
        "sql": Value("string"),
        "target": Value("string"),
        "source_text": Value("string"),
    }
)
# Untruncated token counts and whether a target holds <unk> (the model cannot write it exactly),
# kept only until the statistics are taken.
STATISTICS_COLUMNS = ("source_length", "target_length", "target_unknown")
# What save_to_disk writes for a DatasetDict: the split names, readable without loading anything.


def prepare(arguments: PrepareArguments | None = None, **options: Any) -> dict[str, Any]:
    """Load, tokenize and save WikiSQL; return the summary also written to ``prepare.json``.

    Usage::

        >>> summary = prepare(data_dir="runs/data", limit=50)          # doctest: +SKIP
        >>> summary["counts"]                                      # doctest: +SKIP
        {'train': 50, 'validation': 50, 'test': 50}

    :param arguments: a :class:`PrepareArguments`; or pass its fields as keyword ``options``.
    :raises DataError: bad input data, an unknown source, or ``data_dir`` existing without ``overwrite``.
    :raises ModelError: the tokenizer cannot be loaded.
    :rtype: dict
    """
    arguments = arguments or PrepareArguments(**options)
    started = time.perf_counter()
    out = Path(arguments.data_dir).expanduser().resolve()
    if out.exists() and not arguments.overwrite:
        raise DataError(
            f"{str(out)!r} already exists; pass --overwrite (notebook: overwrite=True) to replace it, "
            "or another --data-dir (notebook: data_dir)"
        )
    tokenizer = load_tokenizer(arguments.model, flag=TOKENIZER_FLAG)
    loaded = {split: load_split(arguments.source, split, arguments.limit) for split in SPLITS}
    texts = DatasetDict(
        {
            split: Dataset.from_list(
                [_text_row(record, arguments.input_format) for record in records], features=TEXT_FEATURES
            )
            for split, (records, _) in loaded.items()
        }
    )
    tokenized = texts.map(
        partial(
            _tokenize,
            encoder=tokenizer.backend_tokenizer,
            unknown_id=tokenizer.unk_token_id,
            max_source_length=arguments.max_source_length,
            max_target_length=arguments.max_target_length,
        ),
        batched=True,
        num_proc=arguments.num_proc if arguments.num_proc > 1 else None,
        desc="Tokenizing",
    )
    summary = {
        "source": arguments.source if arguments.source in NAMED_SOURCES else str(Path(arguments.source).resolve()),
        "tokenizer": "default"
        if arguments.model in (None, "", "default")
        else resolve_model(arguments.model, TOKENIZER_FLAG),
        "input_format": arguments.input_format,
        "counts": {split: len(tokenized[split]) for split in SPLITS},
        "tables": {split: len(tables) for split, (_, tables) in loaded.items()},
        **_length_statistics(tokenized, arguments),
        "arguments": asdict(arguments),
    }
    tokenized = tokenized.remove_columns(list(STATISTICS_COLUMNS))
    summary["seconds"] = round(time.perf_counter() - started, 2)
    _write(out, tokenized, {split: tables for split, (_, tables) in loaded.items()}, summary, arguments.overwrite)
    logger.info("wrote %s in %.1fs", out, summary["seconds"])
    return {**summary, "data_dir": str(out)}


def format_summary(summary: dict) -> str:
    """A few lines for the terminal: where it wrote, and per split the counts, lengths and truncation.

    :param summary: what :func:`prepare` returned.
    :rtype: str
    """
    lines = [
        f"wrote {summary['data_dir']} ({summary['input_format']} input, tokenizer {summary['tokenizer']}, {summary['seconds']}s)"
    ]
    for split in SPLITS:
        source, target, truncated = (
            summary["source_length"][split],
            summary["target_length"][split],
            summary["truncated"][split],
        )
        lines.append(
            f"  {split}: {counted(summary['counts'][split], 'question')}, {counted(summary['tables'][split], 'table')}; "
            f"source tokens p50/p95/max {source['p50']}/{source['p95']}/{source['max']} ({truncated['source']} truncated), "
            f"target tokens {target['p50']}/{target['p95']}/{target['max']} ({truncated['target']} truncated, "
            f"{summary['targets_with_unknown_tokens'][split]} with <unk>)"
        )
    return "\n".join(lines)


def _text_row(record: dict, input_format: str) -> dict:
    return {
        "id": record["id"],
        "table_id": record["table_id"],
        "question": record["question"],
        "header": record["header"],
        "sql": json.dumps(record["sql"]),
        "target": target_text(record, input_format),
        "source_text": source_text(record["question"], record["header"], input_format),
    }


def _tokenize(
    batch: dict, *, encoder: Tokenizer, unknown_id: int, max_source_length: int, max_target_length: int
) -> dict:
    """Token ids of a batch, cut to the maximum lengths; the untruncated lengths come along for the statistics.

    One untruncated pass gives both the lengths and the ids: cutting ``ids[:n - 1] + [</s>]`` is what
    the T5 tokenizer's own ``truncation=True, max_length=n`` produces (a test checks they agree). The ids come from
    the tokenizer's ``tokenizers`` backend, which T5's tokenizer calls for sources and targets alike, without the
    dictionaries of masks transformers builds around each (a third of the time for the demo's 64,000 questions).
    """
    sources = [encoding.ids for encoding in encoder.encode_batch(batch["source_text"])]
    targets = [encoding.ids for encoding in encoder.encode_batch(batch["target"])]
    input_ids = [_truncate(ids, max_source_length) for ids in sources]
    return {
        "input_ids": input_ids,
        "attention_mask": [[1] * len(ids) for ids in input_ids],
        "labels": [_truncate(ids, max_target_length) for ids in targets],
        "source_length": [len(ids) for ids in sources],
        "target_length": [len(ids) for ids in targets],
        "target_unknown": [unknown_id in ids for ids in targets],
    }


def _truncate(ids: list[int], max_length: int) -> list[int]:
    # T5 appends one special token (</s>); keep it last, as the tokenizer's own truncation does.
    return ids if len(ids) <= max_length else ids[: max_length - 1] + ids[-1:]


def _length_statistics(tokenized: DatasetDict, arguments: PrepareArguments) -> dict:
    """Per split: percentiles of untruncated token lengths, how many were truncated, how many targets hold <unk>."""
    limits = {"source_length": arguments.max_source_length, "target_length": arguments.max_target_length}
    statistics: dict = {"source_length": {}, "target_length": {}, "truncated": {}, "targets_with_unknown_tokens": {}}
    for split in SPLITS:
        truncated = {}
        # Whole columns as arrays, not Python lists of 64,000 rows.
        columns = tokenized[split].select_columns(list(STATISTICS_COLUMNS)).with_format("numpy")[:]
        for column, limit in limits.items():
            lengths = numpy.asarray(columns[column], dtype=numpy.int64)
            if len(lengths) == 0:
                statistics[column][split] = {**{f"p{p}": 0 for p in PERCENTILES}, "max": 0}
            else:
                statistics[column][split] = {
                    **{f"p{p}": int(numpy.percentile(lengths, p)) for p in PERCENTILES},
                    "max": int(lengths.max()),
                }
            truncated[column.removesuffix("_length")] = int((lengths > limit).sum())
        statistics["truncated"][split] = truncated
        statistics["targets_with_unknown_tokens"][split] = int(columns["target_unknown"].sum())
    return statistics


def _write(out: Path, tokenized: DatasetDict, tables: dict[str, dict], summary: dict, overwrite: bool) -> None:
    """Write everything beside ``out`` and rename it into place (replacing ``out`` only with ``overwrite``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary shared directory
        tokenized.save_to_disk(str(staging))
        for split, split_tables in tables.items():
            write_jsonl(prepared_tables_path(staging, split), split_tables.values())
        write_json(staging / PREPARE_JSON_NAME, summary)
        if out.exists() and overwrite:
            previous = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            out.rename(previous / out.name)
            staging.rename(out)
            shutil.rmtree(previous)
        else:
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
