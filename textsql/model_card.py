"""The model card: ``model/README.md`` beside every trained model, in huggingface_hub's ``ModelCard`` form.

Training writes it with what training knows (:func:`write_training_card`: data source and input format, steps,
profile, precision, ranks, hardware, the final evaluation's scores); evaluation updates it
(:func:`record_evaluation`, called where ``metrics.json`` is written) with the scores of one split of one source,
beside the trivial baseline's. The front matter is :class:`huggingface_hub.ModelCardData`, its scores a
``model-index`` of :class:`huggingface_hub.EvalResult` (one result per source and split, replaced when that split
is scored again), so ``ModelCard.load`` reads it back and the Hub would show it. The body is for a person: what the
model was trained on, how to call it, its scores beside the baseline, and its limits. Each split's scores sit in
their own marked block of the body, which an evaluation of that split rewrites and which nothing else touches.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from textsql.console import counted
from textsql.constants import DEFAULT_MODEL_DIR, HUB_SOURCE, PREPARE_JSON_NAME, SAMPLE_SOURCE
from textsql.data.wikisql import MIXED_SOURCE, SYNTHETIC_SELECT_SOURCE, SYNTHETIC_SOURCE
from textsql.json_files import read_json
from worker.files import atomic_write

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
TASK_TYPE = "table-question-answering"
TASK_NAME = "Text-to-SQL (WikiSQL)"
WIKISQL_HUB_ID = "Salesforce/wikisql"
# model-index metric types, their names, and the keys of metrics.json (textsql.scoring.evaluate) and of the
# training's logged evaluation (eval_<key>) they come from.
METRICS = {
    "lf_accuracy": "Logical-form accuracy (LF)",
    "ex_accuracy": "Execution accuracy (EX)",
    "parse_rate": "Parse rate",
}
RESULTS_START = "<!-- textsql:results -->"
RESULTS_END = "<!-- /textsql:results -->"
_RESULT_BLOCK = re.compile(r"<!-- result (\S+) -->\n(.*?)(?=<!-- result |\Z)", re.DOTALL)
NOT_EVALUATED = "Not scored yet: run notebook 03 or `textsql infer` on this model.\n"


@dataclass(frozen=True)
class Dataset:
    """A question source as the model index names it: ``type`` (hub id), a readable ``name``, a ``config``."""

    type: str
    name: str
    config: str | None = None


def dataset_of(data: str | Path) -> Dataset:
    """The source of a split: a prepared dataset's recorded source, a named source, a release directory or a file.

    :param data: what ``textsql infer --data-dir/--source/--questions-file`` / :func:`textsql.inference.predict.predict` was given.
    :rtype: Dataset
    """
    path = Path(data).expanduser()
    if (path / PREPARE_JSON_NAME).is_file():
        return dataset_of(str(read_json(path / PREPARE_JSON_NAME).get("source", path.name)))
    named = {
        HUB_SOURCE: Dataset(WIKISQL_HUB_ID, "WikiSQL"),
        SAMPLE_SOURCE: Dataset(WIKISQL_HUB_ID, "WikiSQL, the sample shipped with textsql", SAMPLE_SOURCE),
        SYNTHETIC_SOURCE: Dataset("textsql/synthetic", "Template questions over WikiSQL headers", SYNTHETIC_SOURCE),
        SYNTHETIC_SELECT_SOURCE: Dataset(
            "textsql/synthetic", "Template questions without conditions", SYNTHETIC_SELECT_SOURCE
        ),
        MIXED_SOURCE: Dataset("textsql/synthetic", "WikiSQL sample and template questions", MIXED_SOURCE),
    }
    if str(data) in named:
        return named[str(data)]
    return Dataset("wikisql", f"WikiSQL-format questions from {path.name}", path.stem)


def describe_hardware(world_size: int) -> str:
    """The ranks and the device of this process (rank 0 stands for all), as the card states them.

    :rtype: str
    """
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (gloo)"
    return f"{counted(world_size, 'rank')} on {device}"


def write_training_card(model_dir: str | Path, run: dict, hardware: str | None = None) -> Path:
    """Write ``model_dir/README.md`` after training: front matter and body from the run's summary.

    :param model_dir: the exported model (holding the dataset's ``prepare.json``).
    :param run: the run's summary (``run.json``: model, profile, precision, world size, steps, log history).
    :param hardware: how the ranks ran; by default :func:`describe_hardware` of this process.
    :rtype: pathlib.Path
    """
    model_dir = Path(model_dir)
    prepared = _prepare_record(model_dir)
    source = str(prepared.get("source", "unknown"))
    dataset = dataset_of(source)
    final = _final_evaluation(run.get("log_history", []))
    results = _eval_results(dataset, "validation", final) if final else []
    base = _base_model(str(run.get("model", "")))
    data = ModelCardData(
        language="en",
        license="apache-2.0",
        library_name="transformers",
        base_model=base,
        datasets=[dataset.type] if dataset.type != "wikisql" else None,
        metrics=list(METRICS),
        tags=["text-to-sql", "wikisql", "t5", "deepspeed", "textsql"],
        model_name=f"textsql-{model_dir.resolve().parent.name}",
        eval_results=results or None,
    )
    block = (
        _result_block(_result_key(dataset, "validation"), _scores_table(dataset, "validation", final, None))
        if final
        else f"{RESULTS_START}\n{NOT_EVALUATED}{RESULTS_END}"
    )
    body = _body(run, prepared, source, base, hardware or describe_hardware(int(run.get("world_size", 1))), block)
    return _save(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"), model_dir / CARD_NAME)


def record_evaluation(model_dir: str | Path | None, metrics: dict, data: str | Path, split: str) -> Path | None:
    """Put one split's scores (a ``metrics.json`` report) into the card training wrote; a model without one is left.

    :param model_dir: the evaluated model's directory (``None``: a model loaded from elsewhere).
    :param metrics: :func:`textsql.scoring.evaluate.evaluate`'s report, with its ``baseline``.
    :param data: the questions' source (see :func:`dataset_of`).
    :param split: which split was scored.
    :returns: the card's path, or ``None`` when the model has no card (the embedded T5, a hub model).
    :rtype: pathlib.Path | None
    """
    if model_dir is None or not (Path(model_dir) / CARD_NAME).is_file():
        return None
    path = Path(model_dir) / CARD_NAME
    card = ModelCard.load(path)
    dataset = dataset_of(data)
    # EvalResult.unique_identifier's fields: task, dataset type, config, split, revision.
    scored = (TASK_TYPE, dataset.type, dataset.config, split, None)
    kept = [result for result in card.data.eval_results or [] if result.unique_identifier != scored]
    card.data.eval_results = kept + _eval_results(dataset, split, metrics)
    card.data.model_name = card.data.model_name or f"textsql-{path.resolve().parent.parent.name}"
    block = _scores_table(dataset, split, metrics, metrics.get("baseline"))
    card.text = _with_result(card.text, _result_key(dataset, split), block)
    return _save(card, path)


def _save(card: ModelCard, path: Path) -> Path:
    atomic_write(path, str(card))
    logger.info("model card written to %s", path)
    return path


def _prepare_record(model_dir: Path) -> dict:
    record = model_dir / PREPARE_JSON_NAME
    return read_json(record) if record.is_file() else {}


def _final_evaluation(log_history: list[dict]) -> dict:
    """The last logged evaluation with WikiSQL's scores, by metrics.json's keys."""
    for entry in reversed(log_history):
        if any(f"eval_{key}" in entry for key in METRICS):
            return {key: entry[f"eval_{key}"] for key in METRICS if f"eval_{key}" in entry}
    return {}


def _base_model(model: str) -> str | None:
    """The hub model training started from; ``None`` for weights built from a config (random initialisation)."""
    if not model or model == "default" or Path(model).exists() or model == str(DEFAULT_MODEL_DIR):
        return None
    return model


def _model_label(model: str) -> str:
    """The model's short name: the embedded default's directory name for ``default``."""
    return Path(model).name if model and model != "default" else DEFAULT_MODEL_DIR.name


def _eval_results(dataset: Dataset, split: str, scores: dict) -> list[EvalResult]:
    return [
        EvalResult(
            task_type=TASK_TYPE,
            task_name=TASK_NAME,
            dataset_type=dataset.type,
            dataset_name=dataset.name,
            dataset_config=dataset.config,
            dataset_split=split,
            metric_type=key,
            metric_name=name,
            metric_value=round(float(scores[key]), 4),
        )
        for key, name in METRICS.items()
        if scores.get(key) is not None
    ]


def _result_key(dataset: Dataset, split: str) -> str:
    return f"{dataset.type}:{dataset.config or ''}:{split}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _scores_table(dataset: Dataset, split: str, scores: dict, baseline: dict | None) -> str:
    count = f", {counted(scores['n'], 'question')}" if scores.get("n") else ""
    origin = "textsql infer / notebook 03" if baseline is not None else "training's final evaluation"
    lines = [
        f"**{dataset.name}**, {split} split{count} ({origin})",
        "",
        "| | this model (± standard error, points) | trivial baseline |",
        "|---|---|---|",
    ]
    for key, name in METRICS.items():
        reference = _percent(baseline.get(key)) if baseline is not None else "run `textsql infer`"
        error = scores.get(key.replace("_accuracy", "_standard_error")) if key.endswith("_accuracy") else None
        shown = _percent(scores.get(key)) + ("" if error is None else f" ± {100 * error:.1f}")
        lines.append(f"| {name} | {shown} | {reference} |")
    return "\n".join(lines) + "\n\n"


def _result_block(key: str, table: str) -> str:
    return f"{RESULTS_START}\n<!-- result {key} -->\n{table}{RESULTS_END}"


def _with_result(text: str, key: str, table: str) -> str:
    """The body with one result's block replaced (or added after the others)."""
    start, end = text.find(RESULTS_START), text.find(RESULTS_END)
    if start < 0 or end < start:
        return text.rstrip("\n") + "\n\n## Scores\n\n" + _result_block(key, table) + "\n"
    inside = text[start + len(RESULTS_START) : end].strip("\n") + "\n"
    blocks = {match.group(1): match.group(2) for match in _RESULT_BLOCK.finditer(inside)}
    blocks[key] = table
    rendered = "".join(f"<!-- result {name} -->\n{block}" for name, block in blocks.items())
    return f"{text[:start]}{RESULTS_START}\n{rendered}{text[end:]}"


def _training_table(run: dict, prepared: dict, source: str, base: str | None, label: str, hardware: str) -> str:
    """The card's Training section: where the weights came from, the data and input format, steps, profile, hardware."""
    counts = prepared.get("counts") or {}
    train_loss = next(
        (entry["train_loss"] for entry in reversed(run.get("log_history", [])) if "train_loss" in entry), None
    )
    origin = f"fine-tuned from `{base}`" if base else f"trained from random weights (`{label}`'s architecture)"
    input_format = prepared.get("input_format", "schema")
    return f"""| | |
|---|---|
| model | {origin} |
| data | `{source}`: {counts.get("train", "?")} training questions, {counts.get("validation", "?")} validation |
| input format | `{input_format}` (question and column names as `textsql prepare` wrote them; kept in `prepare.json`) |
| steps | {run.get("global_step", "?")}, final training loss {"n/a" if train_loss is None else f"{train_loss:.4f}"} |
| DeepSpeed profile | `{run.get("profile", "?")}` (ZeRO stage {run.get("zero_stage", "?")}), precision `{run.get("precision", "?")}` |
| hardware | {hardware} |"""


def _body(run: dict, prepared: dict, source: str, base: str | None, hardware: str, results: str) -> str:
    label = _model_label(str(run.get("model") or ""))
    return f"""
# {label} for WikiSQL text-to-SQL (textsql)

A T5 model that writes a WikiSQL query for an English question about a table, given the table's column names:
`SELECT COUNT School/Club Team FROM table WHERE No. = 3` for *How many schools did player number 3 play at?*.
Written by textsql at the end of training; each evaluation (`textsql infer`, notebook 03) adds its scores below.

## Training

{_training_table(run, prepared, source, base, label, hardware)}

## Scores

Logical-form accuracy (LF): the query's column, aggregation and conditions equal the gold query's. Execution
accuracy (EX): the query returns the gold query's result over the table's rows (WikiSQL's own engine, in SQLite).
Parse rate: the share of outputs that are WikiSQL queries over the question's own table (100 % with constrained
decoding). The trivial baseline answers every question with the most common aggregation over the first column
and no condition: a model worth calling beats it.

{results}

## How to call it

```python
from textsql.inference.predictor import Predictor
predictor = Predictor.load("path/to/model")   # this directory
predictor.ask("How many schools did player number 3 play at?", ["Player", "No.", "School/Club Team"])
```

From a shell: `textsql infer --model path/to/model --question "..." --header "Player,No.,School/Club Team"`.
On Cloudera ML the AMP deploys it as a CML Model (`cml/model.py:predict`): POST
`{{"question": ..., "header": [...], "rows": [[...]]}}` and it answers `{{"sql", "query"}}`, plus `"answer"` with rows.
Decoding is constrained to WikiSQL queries over the given header by default.

## Limits

- WikiSQL's grammar only: one table, one selected column, at most one aggregation, conditions joined by AND
  with `=`, `>` and `<`. No joins, ORDER BY, GROUP BY or nested queries.
- The model reads column names, never the rows: values come from the question's words.
- Template questions (the `synthetic` sources) are far easier than WikiSQL's crowd-written ones: scores on
  them show the pipeline learns to read a header, not how it does on WikiSQL.
- A T5 trained from random weights for minutes on a CPU stays near the trivial baseline on real questions;
  real accuracy needs a pretrained T5 (`t5-small` or larger) trained on the full WikiSQL (`--source hub`).
- One training is one sample of its recipe: another seed, or another CPU whose floating-point kernels differ, gives
  another trajectory, and the demo's recipe scored several points apart over three seeds (`python -m bench
  demo-seeds` in the project measures the spread).
- English questions only; answers follow WikiSQL's engine (text compared and returned in lower case).
- WikiSQL is released under the BSD 3-Clause license; T5 under Apache 2.0.
"""
