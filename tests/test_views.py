"""The notebooks' views: a training run's summary; accuracy by query type as bars, predictions beside their gold SQL, one answer."""

from __future__ import annotations

import re

import matplotlib
import pytest

from textsql.data.sql import parsed
from textsql.display.views import format_answer, format_run, plot_accuracy_by_type, predictions_table
from textsql.errors import TextSQLError
from textsql.json_files import write_json, write_jsonl
from textsql.scoring.evaluate import evaluate

matplotlib.use("Agg")

COUNT = {"sel": 0, "agg": 3, "conds": [[1, 0, "3"]]}
PLAIN = {"sel": 1, "agg": 0, "conds": []}
LONG_GOLD = "SELECT Player FROM table WHERE School/Club Team = A school whose name is longer than fifty characters"
LINES = [
    {
        "id": "1",
        "question": "How many wear 3?",
        "pred_sql": "SELECT COUNT Player ...",
        "query": COUNT,
        "error": None,
        "gold_sql": "SELECT COUNT ...",
        "gold_query": COUNT,
    },
    {
        "id": "2",
        "question": "Which number?",
        "pred_sql": "SELECT Player",
        "query": {**PLAIN, "sel": 0},
        "error": None,
        "gold_sql": LONG_GOLD,
        "gold_query": PLAIN,
    },
    {
        "id": "3",
        "question": "Nonsense?",
        "pred_sql": "SELECT SELECT",
        "query": None,
        "error": "no column",
        "gold_sql": "SELECT No.",
        "gold_query": PLAIN,
    },
]


def test_bars_per_query_type_with_their_values():
    metrics = evaluate(None, LINES)
    by_aggregation, by_conditions = plot_accuracy_by_type(metrics).axes
    assert [tick.get_text() for tick in by_aggregation.get_xticklabels()] == ["none\nn=2", "COUNT\nn=1"]
    assert [bar.get_height() for bar in by_aggregation.patches] == [0.0, 100.0]
    assert [tick.get_text() for tick in by_conditions.get_xticklabels()] == ["0\nn=2", "1\nn=1"]
    assert [text.get_text() for text in by_conditions.texts] == ["0%", "100%"], "each bar says its value, 0 % included"


def test_predictions_beside_gold_whole_and_the_wrong_ones_errors_first(tmp_path):
    path = write_jsonl(tmp_path / "predictions.jsonl", LINES)
    table = predictions_table(path)
    assert list(table.data["right"]) == [True, False, False]
    assert LONG_GOLD in table.to_html(), "the gold SQL is shown whole"
    worst = predictions_table(path, wrong_only=True).data
    assert list(worst["question"]) == ["Nonsense?", "Which number?"]
    assert len(predictions_table(path, limit=1).data) == 1


# run.json of a real 4-step demo run (2 ranks, evaluated every 2 steps), as textsql.training.train wrote it.
EVALUATION = {
    "eval_exact_match": 0.0,
    "eval_lf_accuracy": 0.25,
    "eval_parse_rate": 1.0,
    "eval_runtime": 40.9851,
    "eval_samples_per_second": 1.171,
    "eval_steps_per_second": 0.073,
}
RUN = {
    "engine": "deepspeed.runtime.engine.DeepSpeedEngine",
    "zero_stage": 0,
    "world_size": 2,
    "profile": "zero0",
    "profile_chosen_by": "auto",
    "precision": "fp32",
    "model": "default",
    "resumed_from": None,
    "global_step": 4,
    "log_history": [
        {"loss": 9.9, "grad_norm": 1.2, "learning_rate": 0.001, "epoch": 0.17, "step": 1},
        {**EVALUATION, "eval_loss": 8.762718200683594, "epoch": 0.3333333333333333, "step": 2},
        {**EVALUATION, "eval_loss": 8.261699676513672, "eval_lf_accuracy": 0.5, "epoch": 0.6666666666666666, "step": 4},
        {
            "train_runtime": 105.6756,
            "train_samples_per_second": 0.303,
            "train_steps_per_second": 0.038,
            "total_flos": 9175695360.0,
            "train_loss": 9.420011520385742,
            "epoch": 0.6666666666666666,
            "step": 4,
        },
    ],
}


def test_a_run_reads_as_a_short_summary_with_one_row_per_evaluation(tmp_path):
    write_json(tmp_path / "run.json", RUN)
    lines = format_run(tmp_path).splitlines()
    assert lines[0] == (
        f"{tmp_path / 'run.json'}: 4 steps of model default on 2 rank(s), profile zero0 "
        "(ZeRO-0; auto: the estimate's recommendation), fp32, DeepSpeedEngine"
    )
    assert lines[1] == "training: 106 s, 0.30 samples/s, train loss 9.420"
    assert lines[2].split() == ["step", "exact_match", "lf_accuracy", "parse_rate", "loss"], "scores only, no timings"
    assert lines[3].split() == ["2", "0.0%", "25.0%", "100.0%", "8.763"]
    assert lines[4].split() == ["4", "0.0%", "50.0%", "100.0%", "8.262"]
    assert len(lines) == 5


def test_a_run_shows_the_hosts_it_checked_and_the_all_reduce_bandwidth(tmp_path):
    write_json(tmp_path / "run.json", RUN)
    inventory = {"python": "3.11.7", "torch": "2.13.0+cpu", "deepspeed": "0.19.8", "free_disk_bytes": 3 * 1024**3}
    hosts = [
        {"pod": "local-0", "address": "127.0.0.2", "slots": 1, "socket_ifname": "lo", "inventory": inventory},
        {"pod": "gpu-1", "address": "10.0.0.3", "slots": 8, "socket_ifname": "eth0", "inventory": None},
    ]
    write_json(tmp_path / "cluster.json", {"master": inventory, "hosts": hosts})
    sizes = [
        {"bytes": 4096, "seconds": 0.2, "bus_gbps": 1.83e-05},
        {"bytes": 8388608, "seconds": 0.1, "bus_gbps": 0.0877},
    ]
    write_json(tmp_path / "collective.json", {"world_size": 2, "backend": "gloo", "hosts": [], "sizes": sizes})
    lines = format_run(tmp_path).splitlines()
    assert lines[1].split()[:6] == ["host", "pod", "python", "torch", "deepspeed", "transformers"]
    assert " ".join(lines[2].split()) == "master - 3.11.7 2.13.0+cpu 0.19.8 ? none (CPU) - - 3.0 GiB"
    assert " ".join(lines[3].split()) == "127.0.0.2 local-0 3.11.7 2.13.0+cpu 0.19.8 ? none (CPU) lo ? 3.0 GiB"
    assert lines[4].split() == ["10.0.0.3", "gpu-1", "?", "?", "?", "?", "none", "(CPU)", "eth0", "?", "?"]
    assert lines[5] == "all-reduce on 2 ranks (gloo), bus bandwidth: 4 KiB 1.83e-05 GB/s, 8192 KiB 0.0877 GB/s"
    assert lines[6] == "training: 106 s, 0.30 samples/s, train loss 9.420"


def test_a_run_shows_the_collective_figures_per_host_from_its_summary(tmp_path):
    from textsql.training.collective import figures

    timings = [[(0.0, 1.51), (1.5, 0.01)]] * 3  # the ranks on 127.0.0.3 joined 1.5 s late on every size
    write_json(tmp_path / "run.json", RUN | {"collective": figures(["127.0.0.2", "127.0.0.3"], timings, "gloo")})
    write_json(tmp_path / "collective.json", {"world_size": 9, "backend": "old", "sizes": []})  # run.json's come first
    lines = format_run(tmp_path).splitlines()
    assert lines[1].startswith("all-reduce on 2 ranks (gloo), bus bandwidth: 4 KiB ")
    # Both hosts' bandwidth once both had joined (the 1.5 s rank 0 waited is not the network's).
    assert lines[2] == "  127.0.0.2        ok    0.839 GB/s at 8 MiB, others waited 0.00 s for it"
    assert lines[3].split()[:2] == ["127.0.0.3", "slow"] and lines[3].endswith("others waited 1.50 s for it")


def test_a_run_that_wrote_no_summary_points_at_its_log(tmp_path):
    with pytest.raises(TextSQLError, match="no run.json in .*the training did not finish; see .*launch.log"):
        format_run(tmp_path)


def test_an_answer_is_its_sql_and_why_it_is_no_query():
    header = ["Player", "No."]
    right = "SELECT Player FROM table WHERE No. = 3"
    assert format_answer({"sql": right, **parsed(right, header)}) == right
    wrong = "SELECT Team FROM table"
    shown = format_answer({"sql": wrong, **parsed(wrong, header)})
    assert shown.startswith(f"{wrong}\n(not a query over this table: ") and parsed(wrong, header)["error"] in shown


def test_a_worker_written_question_is_shown_as_text_not_run_as_html(tmp_path):
    """predictions.jsonl lies in a directory the pods can write: its text reaches notebook 03's table as text."""
    attack = "<img src=x onerror=alert(document.cookie)><script>fetch('/api/contents')</script>"
    hostile = {**LINES[0], "question": attack, "pred_sql": "</td><b>bold</b>", "error": "<i>x</i>"}
    html = predictions_table(write_jsonl(tmp_path / "predictions.jsonl", [hostile])).to_html()
    assert "<img" not in html and "<script" not in html and "<b>" not in html and "<i>" not in html
    assert "&lt;img src=x onerror=alert(document.cookie)&gt;" in html


def test_a_worker_written_question_is_not_typeset_as_math(tmp_path):
    """JupyterLab typesets $...$ in an output's HTML with MathJax unless the element opts out: a question reading
    `$\\Huge 3$` would be drawn, not shown as the text it is."""
    hostile = {**LINES[0], "question": r"how many wear $\Huge 3$?"}
    html = predictions_table(write_jsonl(tmp_path / "predictions.jsonl", [hostile])).to_html()
    table = re.search(r"<table[^>]*>", html).group()
    classes = re.search(r'class="([^"]*)"', table)
    # MathJax 3 (JupyterLab 4) skips mathjax_ignore; MathJax 2 (classic Notebook, nbviewer) tex2jax_ignore.
    assert classes and {"mathjax_ignore", "tex2jax_ignore"} <= set(classes.group(1).split()), table
