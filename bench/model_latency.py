"""``model_latency_s``: one question answered by the CML Model (``cml/model.py:predict``) on the CPU.

CML's guidance is that a model answers well under a second; the figure states each latency as a share of that
second. Each model is served in a fresh Python as a CML replica serves it: the file imported by its path
(``import_s``, before any request), the first request (``cold_s``: loading the model directory, then answering),
then ``requests`` more (``warm_s``, their median and spread; ``warm_cpu_s``, the CPU time, which waiting for a
shared core does not inflate), questions and headers of the shipped sample's validation split with their rows,
constrained decoding as served. The baseline, in the same replica and alternated with the served requests: the same
questions decoded freely, right after each served one and at most as long as its answer (``free_warm_s``;
``constrained_over_free_cpu`` the ratio of the CPU-time medians). Models: the embedded small T5 and one of
t5-small's shape, both with random weights from the fixed seed (no trained model ships with the project), so the
generated queries' lengths are reported beside the times (``tokens`` per answer, and ms per generated token):
a trained model writes its query and stops, a random one may run to the length limit.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.profiles import model_dir as t5_small_shape
from textsql.constants import DEFAULT_MODEL_DIR, PROJECT_DIR
from textsql.data.wikisql import load_records
from textsql.model import load_model, load_tokenizer

logger = logging.getLogger(__name__)

BUDGET_S = 1.0  # CML's guidance: a model answers well under a second
TIMEOUT_S = 900
# What one replica runs: import the model file, then answer the requests one by one, timing each.
REPLICA = """
import importlib.util, json, sys, time
started = time.perf_counter()
spec = importlib.util.spec_from_file_location("model", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
imported = time.perf_counter() - started
from textsql.arguments import GenerationOptions
from textsql.inference.serving import served_model_dir, served_predictor

def timed(work):
    started, started_cpu = time.perf_counter(), time.process_time()
    response = work()
    return [time.perf_counter() - started, time.process_time() - started_cpu, response]

served, unconstrained = [], []
for request in json.loads(sys.argv[2]):
    served.append(timed(lambda: module.predict(request)))
    predictor = served_predictor(served_model_dir())
    # The baseline writes as many tokens as the served answer at most: a random model's free output would otherwise
    # run to the length limit, where the grammar ends the query.
    length = len(predictor.tokenizer(served[-1][2]["sql"])["input_ids"])
    free = GenerationOptions(constrained=False, max_new_tokens=length)
    unconstrained.append(timed(lambda: predictor.ask(request["question"], request["header"], free)))
print(json.dumps({"import_s": imported, "served": served, "free": unconstrained}))
"""


@dataclass(frozen=True)
class Sizes:
    """How many warm requests follow the cold one, and how many threads the replica's torch uses."""

    requests: int = 10
    threads: int = 2


def run(work: Path, sizes: Sizes = Sizes()) -> dict:
    """Serve each model in a fresh replica and time its answers.

    :param work: scratch directory (the models are saved there with their weights).
    :rtype: dict
    """
    records = load_records("sample", "validation", sizes.requests + 1)
    requests = [
        {"question": item["question"], "header": item["header"], **({"rows": item["rows"]} if item["rows"] else {})}
        for item in records
    ]
    models = {
        "t5-tiny (embedded)": _saved(DEFAULT_MODEL_DIR, work / "served-t5-tiny"),
        "t5-small shape": _saved(t5_small_shape(work), work / "served-t5-small"),
    }
    figure: dict = {
        "what": "one question answered by cml/model.py:predict on the CPU, in a fresh replica per model",
        "budget_s": BUDGET_S,
        "threads": sizes.threads,
        "models": {},
    }
    for name, directory in models.items():
        figure["models"][name] = measured = _replica(directory, requests, sizes.threads)
        logger.info(
            "%s: cold %.2fs, warm median %.3fs (%.0f%% of the %.0fs budget), %s tokens per answer, "
            "constrained/free CPU time %.2f",
            name,
            measured["cold_s"],
            measured["warm_s"]["median"],
            100 * measured["warm_share_of_budget"],
            BUDGET_S,
            measured["tokens_median"],
            measured["constrained_over_free_cpu"],
        )
    return figure


def _saved(source: Path, target: Path) -> Path:
    """A model directory as training exports one: weights (from the fixed seed) and tokenizer."""
    if not target.exists():
        load_model(source).save_pretrained(target)
        load_tokenizer(source).save_pretrained(target)
    return target


def _replica(directory: Path, requests: list[dict], threads: int) -> dict:
    environment = os.environ | {
        "TEXTSQL_MODEL_DIR": str(directory),
        "OMP_NUM_THREADS": str(threads),
        "CUDA_VISIBLE_DEVICES": "",
    }
    result = subprocess.run(
        [sys.executable, "-c", REPLICA, str(PROJECT_DIR / "cml" / "model.py"), json.dumps(requests)],
        check=True,
        env=environment,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    replica = json.loads(result.stdout.strip().splitlines()[-1])
    errors = [response["error"] for *_, response in replica["served"] if "sql" not in response]
    if errors:
        raise RuntimeError(f"the served model refused a request: {errors[0]}")
    (cold, _, _), *warm = replica["served"]
    free = replica["free"][1:]
    tokenizer = load_tokenizer(directory)
    tokens = [len(tokenizer(response["sql"])["input_ids"]) for *_, response in warm]
    free_tokens = [len(tokenizer(response["sql"])["input_ids"]) for *_, response in free]
    median = statistics.median(seconds for seconds, _, _ in warm)
    return {
        "import_s": round(replica["import_s"], 3),
        "cold_s": round(cold, 3),
        "warm_s": _spread([seconds for seconds, _, _ in warm]),
        "warm_cpu_s": _spread([cpu for _, cpu, _ in warm]),
        "warm_share_of_budget": round(median / BUDGET_S, 3),
        "cold_share_of_budget": round(cold / BUDGET_S, 3),
        # The same questions decoded freely in the same replica, each right after its served answer: the baseline.
        "free_warm_s": _spread([seconds for seconds, _, _ in free]),
        "constrained_over_free_cpu": round(
            statistics.median(cpu for _, cpu, _ in warm) / statistics.median(cpu for _, cpu, _ in free), 2
        ),
        "tokens_median": statistics.median(tokens),
        "ms_per_token": round(1000 * sum(seconds for seconds, _, _ in warm) / sum(tokens), 2),
        # Free decoding stops where the served answer did at the latest: compare per token too.
        "free_tokens_median": statistics.median(free_tokens),
        "constrained_over_free_cpu_per_token": round(
            (sum(cpu for _, cpu, _ in warm) / sum(tokens)) / (sum(cpu for _, cpu, _ in free) / sum(free_tokens)), 2
        ),
        "example_sql": warm[0][2]["sql"],
    }


def _spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }
