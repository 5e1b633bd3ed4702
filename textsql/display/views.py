"""The notebooks' views of what a run wrote: a training run's summary (notebook 02), and of a scored run
accuracy by query type as a plot, predictions beside their gold SQL and one answer (notebook 03).

Each reads what the run left on disk (``run.json``, ``metrics.json``'s breakdowns, ``predictions.jsonl``)
and shows it for a person, so the notebook's cells stay one call each; the files stay as they are. What a
worker can write (``run.json`` from rank 0, ``cluster.json``, ``collective.json`` on a shared run directory) is
read through :func:`_read_shown`: its strings reach the notebook or terminal inert (:mod:`textsql.sanitize`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textsql.constants import CLUSTER_FILE_NAME, COLLECTIVE_FILE_NAME, LAUNCH_LOG_NAME, RUN_SUMMARY_NAME
from textsql.errors import TextSQLError
from textsql.json_files import read_json, read_jsonl
from textsql.sanitize import sanitized_record
from textsql.scoring.evaluate import logical_form_key

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from pandas.io.formats.style import Styler

logger = logging.getLogger(__name__)

# metrics.json's breakdowns, and how each is titled.
BREAKDOWNS = {"by_aggregation": "aggregation", "by_conditions": "WHERE conditions"}
SCORES = {"lf_accuracy": "logical form", "ex_accuracy": "execution"}
TABLE_COLUMNS = ["question", "pred_sql", "gold_sql", "right", "error"]
# The classes MathJax skips: 3 (JupyterLab 4) and 2 (the classic Notebook, nbviewer), as pandas names them.
SHOWN_AS_TEXT = "mathjax_ignore tex2jax_ignore"
# The trainer's evaluation entries that are scores (shown per step); the rest are its timings.
EVAL_PREFIX = "eval_"
EVAL_TIMINGS = ("runtime", "samples_per_second", "steps_per_second", "epoch")


def format_run(run_dir: str | Path) -> str:
    """A training run's ``run.json`` for a person: how it ran, how long, and each evaluation's scores by step.

    Usage::

        >>> print(format_run("runs/notebook"))                  # doctest: +SKIP
        run.json: 4 steps of model default on 2 rank(s), profile zero0 (ZeRO-0), fp32, DeepSpeedEngine
        training: 106 s, 0.30 samples/s, train loss 9.420
        step  loss   exact_match  lf_accuracy  parse_rate
           2  8.763         0.0%         0.0%      100.0%

    :param run_dir: the run directory (``run_dir`` of notebook 02, ``--run-dir`` of ``textsql train``).
    :raises TextSQLError: when the run wrote no ``run.json``, naming the run's log.
    :rtype: str
    """
    path = Path(run_dir) / RUN_SUMMARY_NAME
    if not path.is_file():
        raise TextSQLError(
            f"no {RUN_SUMMARY_NAME} in {str(run_dir)!r}: the training did not finish; see {Path(run_dir) / LAUNCH_LOG_NAME}"
        )
    run = _read_shown(path)
    chosen = "; auto: the estimate's recommendation" if run.get("profile_chosen_by") == "auto" else ""
    lines = [
        (
            f"{path}: {run['global_step']} steps of model {run['model']} on {run['world_size']} rank(s), profile {run['profile']} "
            f"(ZeRO-{run['zero_stage']}{chosen}), {run['precision']}, {run['engine'].rsplit('.', 1)[-1]}"
        )
    ]
    if run.get("resumed_from"):
        lines.append(f"resumed from {run['resumed_from']}")
    lines += _cluster_lines(Path(run_dir), run.get("collective"))
    history = run.get("log_history", [])
    for entry in history:
        if "train_runtime" in entry:
            lines.append(
                f"training: {entry['train_runtime']:.0f} s, {entry['train_samples_per_second']:.2f} samples/s, "
                f"train loss {entry['train_loss']:.3f}"
            )
    evaluations = [entry for entry in history if "eval_loss" in entry]
    scores = [
        key
        for key in dict.fromkeys(key for entry in evaluations for key in entry)
        if key.startswith(EVAL_PREFIX) and key[len(EVAL_PREFIX) :] not in EVAL_TIMINGS
    ]
    if evaluations:
        names = [key[len(EVAL_PREFIX) :] for key in scores]
        lines.append("step  " + "  ".join(f"{name:>{max(len(name), 6)}}" for name in names))
        for entry in evaluations:
            lines.append(
                f"{entry['step']:>4}  "
                + "  ".join(f"{_score(key, entry.get(key)):>{max(len(name), 6)}}" for key, name in zip(scores, names))
            )
    return "\n".join(lines)


def _cluster_lines(run_dir: Path, collective: dict | None = None) -> list[str]:
    """The cluster check's table when the run has one, then the ranks' all-reduce figures (``run.json``'s, else
    ``collective.json``, which a run stopped by the check leaves)."""
    collective = collective or _read_collective(run_dir)
    lines = (
        cluster_table(_read_shown(run_dir / CLUSTER_FILE_NAME), collective)
        if (run_dir / CLUSTER_FILE_NAME).is_file()
        else []
    )
    return lines + (collective_lines(collective) if collective else [])


def format_cluster(run_dir: str | Path | None = None) -> str:
    """The cluster check as a short table: this machine (the master every worker is compared with) and, for a
    run the check has seen, each host with its versions, accelerators, interface and all-reduce bandwidth, then
    each problem the check found, one line each.

    Usage::

        >>> print(format_cluster("runs/notebook"))                # doctest: +SKIP
        host             pod            python  torch          deepspeed  transformers  accelerators  interface  all-reduce     free disk
        master           -              3.11.7  2.13.0+cpu     0.19.8     5.23.0        none (CPU)    -          -              40.1 GiB
        127.0.0.2        local-0        3.11.7  2.13.0+cpu     0.19.8     5.23.0        none (CPU)    lo         0.376 GB/s     40.1 GiB

    :param run_dir: a run directory (its ``cluster.json``, ``run.json`` or ``collective.json``); None: this machine only.
    :rtype: str
    """
    from worker.inventory import collect

    path = Path(run_dir) / CLUSTER_FILE_NAME if run_dir is not None else None
    if path is not None and path.is_file():
        record = _read_shown(path)
    else:
        record = {"master": collect(None, Path(run_dir) if run_dir is not None else Path.cwd()).to_dict(), "hosts": []}
    return "\n".join(cluster_table(record, _read_collective(Path(run_dir)) if run_dir is not None else None))


def cluster_table(record: dict, collective: dict | None = None) -> list[str]:
    """``cluster.json``'s master and hosts, one row each, with each host's all-reduce bandwidth at the largest size
    from ``collective`` (:func:`textsql.training.collective.figures`), then its problems, one line each.

    :rtype: list[str]
    """
    # A host's bandwidth at the largest size, and "slow" where the check found it so.
    bandwidth = {
        host["host"]: f"{host['sizes'][-1]['bus_gbps']:.3g} GB/s" + (" slow" if host["result"] == "slow" else "")
        for host in (collective or {}).get("per_host", [])
    }
    columns = ("host", "pod", "python", "torch", "deepspeed", "transformers", "accelerators", "interface", "all-reduce")
    widths = (16, 14, 7, 14, 10, 13, 22, 10, 14)
    lines = [" ".join(f"{name:<{width}}" for name, width in zip(columns, widths)) + " free disk"]
    rows = [("master", "-", "-", record["master"], "-")] + [
        (
            host["address"],
            host["pod"],
            host.get("socket_ifname") or "?",
            host.get("inventory") or {},
            bandwidth.get(host["address"], "?"),
        )
        for host in record["hosts"]
    ]
    for address, pod, interface, found, all_reduce in rows:
        devices = (
            f"{found.get('accelerators', 0)} x {found['accelerator_model']}"
            if found.get("accelerators")
            else "none (CPU)"
        )
        free = found.get("free_disk_bytes")
        versions = [found.get(name) or "?" for name in ("python", "torch", "deepspeed", "transformers")]
        cells = [address, pod, *versions, devices, interface, all_reduce]
        lines.append(
            " ".join(f"{cell:<{width}}" for cell, width in zip(cells, widths))
            + f" {'?' if free is None else f'{free / 1024**3:.1f} GiB'}"
        )
    return lines + [f"problem: {problem}" for problem in record.get("problems", [])]


def _read_collective(run_dir: Path) -> dict | None:
    """The collective check's figures: ``run.json``'s, else ``collective.json`` (a run the check stopped), else None."""
    summary = run_dir / RUN_SUMMARY_NAME
    if summary.is_file() and _read_shown(summary).get("collective"):
        return _read_shown(summary)["collective"]
    return _read_shown(run_dir / COLLECTIVE_FILE_NAME) if (run_dir / COLLECTIVE_FILE_NAME).is_file() else None


def _read_shown(path: Path) -> Any:
    """A JSON file a worker may have written, its strings made safe to show."""
    return sanitized_record(read_json(path))


def collective_lines(figures: dict) -> list[str]:
    """The collective check's figures (:func:`textsql.training.collective.figures`): bus bandwidth per size, then
    each host's result, bandwidth at the largest size and how long the others waited for it.

    :rtype: list[str]
    """
    lines = [
        f"all-reduce on {figures['world_size']} ranks ({figures['backend']}), bus bandwidth: "
        + ", ".join(f"{size['bytes'] / 1024:g} KiB {size['bus_gbps']:.3g} GB/s" for size in figures["sizes"])
    ]
    for host in figures.get("per_host", []):
        largest = host["sizes"][-1]
        lines.append(
            f"  {host['host']:<16} {host['result']:<5} "
            f"{largest['bus_gbps']:.3g} GB/s at {largest['bytes'] / 1024**2:g} MiB, "
            f"others waited {max(host['waited_for_s']):.2f} s for it"
        )
    return lines


def _score(key: str, value: float | None) -> str:
    # Losses are nats; every other evaluation score is a share of the questions.
    if value is None:
        return "-"
    return f"{value:.3f}" if key.endswith("loss") else f"{value:.1%}"


def format_answer(answer: dict) -> str:
    """One answer of :func:`textsql.inference.predictor.ask` for a person: the SQL, and why it is no query when it is not.

    :param answer: ``{"sql", "query", "error"}`` as :func:`textsql.inference.predictor.ask` returns it.
    :rtype: str
    """
    if answer.get("error"):
        return f"{answer['sql']}\n(not a query over this table: {answer['error']})"
    return answer["sql"]


def plot_accuracy_by_type(metrics: dict[str, Any]) -> Figure:
    """Bars of logical-form (and, where scored, execution) accuracy per aggregation and per number of conditions.

    Each bar group is labelled with its share of the questions (``n``), since a type with two
    questions swings from 0 to 100 %.

    Usage::

        >>> plot_accuracy_by_type(summary["metrics"])          # doctest: +SKIP

    :param metrics: an :func:`textsql.scoring.evaluate.evaluate` report (``metrics.json``).
    :rtype: matplotlib.figure.Figure
    """
    import matplotlib.pyplot as plt
    import numpy as np

    scores = [key for key in SCORES if metrics.get(key) is not None]
    figure, panels = plt.subplots(1, len(BREAKDOWNS), figsize=(12, 4), sharey=True)
    for axes, (section, title) in zip(panels, BREAKDOWNS.items()):
        groups = metrics[section]
        positions = np.arange(len(groups))
        width = 0.8 / len(scores)
        for offset, key in enumerate(scores):
            values = [100 * (row[key] or 0.0) for row in groups.values()]
            bars = axes.bar(positions + (offset - (len(scores) - 1) / 2) * width, values, width, label=SCORES[key])
            # The value on each bar: a 0 % bar is otherwise invisible.
            axes.bar_label(bars, fmt="%.0f%%", fontsize=8)
        axes.set_xticks(positions, [f"{name}\nn={row['n']}" for name, row in groups.items()])
        axes.set_title(f"by {title}")
        axes.set_ylim(0, 100)
        axes.grid(axis="y", alpha=0.3)
    panels[0].set_ylabel("accuracy %")
    panels[0].legend()
    figure.tight_layout()
    return figure


def predictions_table(predictions: str | Path, limit: int = 8, wrong_only: bool = False) -> Styler:
    """Predicted SQL beside the gold SQL, one question a row, with whether the logical form is right.

    Shown whole and left-aligned (a DataFrame's own view cuts text at 50 characters, right-aligned), so the
    two queries can be read against each other. Every cell is shown as the text it is: the predictions file lies
    where the pods may write, and a Styler renders its cells as raw HTML unless told to escape, which JupyterLab
    then typesets as math between ``$`` signs unless the table opts out.

    :param predictions: ``predictions.jsonl`` written by :func:`textsql.inference.predict.predict`.
    :param limit: rows shown.
    :param wrong_only: only wrong predictions, those that are no query first.
    :returns: a pandas ``Styler``; its ``data`` is the ``DataFrame``.
    :rtype: pandas.io.formats.style.Styler
    """
    import pandas as pd

    rows = []
    for line in read_jsonl(predictions):
        right = (
            line.get("query") is not None
            and line.get("gold_query") is not None
            and (logical_form_key(line["query"]) == logical_form_key(line["gold_query"]))
        )
        rows.append({**{name: line.get(name) for name in TABLE_COLUMNS}, "right": right})
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    if wrong_only:
        table = table[~table["right"]].sort_values("error", key=lambda errors: errors.isna(), kind="stable")
    return (
        table.head(limit)
        .reset_index(drop=True)
        .style.format(escape="html")
        .set_table_attributes(f'class="{SHOWN_AS_TEXT}"')
        .set_properties(**{"text-align": "left"})
        .set_table_styles([{"selector": "th", "props": [("text-align", "left")]}])
    )
