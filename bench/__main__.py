"""``python -m bench`` (``make bench``): measure every figure and write bench/results.json and bench/README.md.

``--only train,infer`` re-measures some figures and keeps the others from the existing results.json;
``--smoke`` runs at the smallest sizes that still exercise each code path (for tests/test_bench.py).
``python -m bench gpu-quick`` (``make bench-gpu``) runs alone: the short GPU comparison of :mod:`bench.gpu_quick`,
written to ``gpu_quick.json`` in ``--out`` and printed as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import (
    gpu,
    gpu_quick,
    inference,
    model_latency,
    profiles,
    quick_arms,
    quick_report,
    recovery,
    rendezvous,
    startup,
    step_ops,
    store,
    tokenization,
    train_padding,
)
from bench.fullscale import prepare_data
from bench.machine import describe_machine, releases
from bench.ours import available
from bench.report import PROFILES_KEY, write
from textsql.json_files import read_json, write_json

logger = logging.getLogger("bench")

BENCH_DIR = Path(__file__).resolve().parent
FIGURE_NAMES = (
    "prepare",
    "rendezvous",
    "train",
    "infer",
    "constrained",
    "profiles",
    "startup",
    "recovery",
    "ops",
    "shrink",
    "gpu",
    "model-latency",
    "store",
)
SMOKE = {
    "model-latency": model_latency.Sizes(requests=2),
    "prepare": tokenization.Sizes(repetitions=1, warmup=0, dev_questions=200),
    "rendezvous": rendezvous.Sizes(counts=(4,), repetitions=1, warmup=0, agents=None),
    "train": train_padding.Sizes(examples=16, batch_size=8, repetitions=1, warmup_steps=1),
    "infer": inference.Sizes(questions=4, max_new_tokens=4, repetitions=1, warmup_questions=1),
    "constrained": inference.ConstrainedSizes(questions=4, max_new_tokens=12, repetitions=1),
    "profiles": profiles.Sizes(profiles=("zero0",), steps=2, skip_steps=1, batch_size=2, repetitions=1, warmup=0),
    "startup": startup.Sizes(repetitions=1, warmup=0),
    "recovery": recovery.Sizes(steps=4, save_steps=2, kill_after_step=3, batch_size=4, repetitions=1),
    "ops": step_ops.OpsSizes(steps=2, tiny_model=True),
    "store": store.Sizes(steps=3, save_steps=1, repetitions=1),
    # Full-scale data, the tiny T5 and a few steps: every part runs, on the CPU in a few minutes.
    "shrink": recovery.Sizes(steps=4, save_steps=2, kill_after_step=3, batch_size=4, repetitions=1),
    "gpu": gpu.Sizes(
        warmup_steps=1,
        timed_steps=2,
        tiny_model=True,
        old_batch=4,
        eval_questions=32,
        token_budget=2048,
        profiles=("zero1",),  # what auto picks on CPUs: the default's run stands for it (one launch fewer)
        target_eval_loss=100.0,
        loss_steps=4,
        eval_steps=2,
        curve_steps=4,
        curve_window=2,
        infer=inference.Sizes(questions=4, max_new_tokens=4, repetitions=1, warmup_questions=1),
    ),
}
FULL = {
    "model-latency": model_latency.Sizes(),
    "prepare": tokenization.Sizes(),
    "rendezvous": rendezvous.Sizes(),
    "train": train_padding.Sizes(),
    "infer": inference.Sizes(),
    "constrained": inference.ConstrainedSizes(),
    "profiles": profiles.Sizes(),
    "startup": startup.Sizes(),
    "recovery": recovery.Sizes(),
    "ops": step_ops.OpsSizes(),
    "store": store.Sizes(),
    "shrink": recovery.Sizes(steps=6, save_steps=2, kill_after_step=3, batch_size=4, repetitions=1),
    "gpu": gpu.Sizes(),
}


def measure(name: str, sizes, data_dir: str, work: Path, device: str | None, save) -> dict[str, dict]:
    """Run one figure; its results.json entries (``save`` writes a figure's entries so far, for long ones).

    :rtype: dict[str, dict]
    """
    if name == "prepare":
        return {"prepare_examples_per_s": tokenization.run(sizes)}
    if name == "model-latency":
        return {"model_latency_s": model_latency.run(work, sizes)}
    if name == "rendezvous":
        return rendezvous.run(sizes)
    if name == "train":
        return {"train_speedup_dynamic_padding": train_padding.run(data_dir, sizes)}
    if name == "infer":
        return {"infer_speedup_batched": inference.run(data_dir, sizes)}
    if name == "constrained":
        return {"infer_constrained_over_free": inference.run_constrained(sizes)}
    if name == "profiles":
        return {PROFILES_KEY: profiles.run(data_dir, work, sizes)}
    if name == "recovery":
        return {"recovery_local_downtime_s": recovery.run(data_dir, work, sizes)}
    if name == "ops":
        return {"step_ops": step_ops.run_step_ops(prepare_data(work, "schema"), work, sizes)}
    if name == "store":
        return {"checkpoint_store": store.run(data_dir, work, sizes)}
    if name == "shrink":
        return {"recovery_shrink_downtime_s": recovery.run_shrink(data_dir, work, sizes)}
    if name == "gpu":
        device = device or ("cuda" if available() else None)
        if device is None:
            logger.info("gpu: no CUDA device here, section skipped (results.json keeps any earlier one)")
            return {}
        return {
            "gpu": gpu.run(
                prepare_data(work, "schema"), data_dir, work, sizes, device, save=lambda section: save({"gpu": section})
            )
        }
    return {"startup_to_first_step_s": startup.run(data_dir, work, sizes)}


def measure_gpu_quick(
    sizes: quick_arms.QuickSizes, device: str, out: Path, work: Path | None, budget: gpu_quick.Budget
) -> int:
    """Run :mod:`bench.gpu_quick`, write its JSON (with the machine and releases) into ``out`` after each arm with a
    line of the ``budget`` spent, print its table, and keep the scratch directory's logs in ``out`` whatever happens.

    :rtype: int
    """
    path = out / gpu_quick.RESULT_NAME
    out.mkdir(parents=True, exist_ok=True)
    where = _where()

    def save(result: dict) -> None:
        write_json(path, {**result, **where})
        part = result["done"][-1] if result.get("done") else list(result["arms"])[-1]
        print(f"gpu-quick: arm {part} done; {budget.spent()}", flush=True)

    # `timeout` ends the run with SIGTERM: unwind, so the logs are kept.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    with tempfile.TemporaryDirectory(prefix="textsql-bench-") as scratch:
        work = work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        try:
            result = gpu_quick.run(prepare_data(work, "schema"), work, sizes, device, save=save, budget=budget)
        finally:
            kept = gpu_quick.keep_logs(work, out)
            print(f"gpu-quick: kept {len(kept)} logs in {out / gpu_quick.LOGS}", flush=True)
    # From a cold process, imports and data preparation included: what a run on a GPU machine costs in all.
    where["process_wall_s"] = round(time.time() - psutil.Process().create_time(), 1)
    write_json(path, {**result, **where})
    print(quick_report.table(result))
    print(f"{where['process_wall_s']} s since the process started; wrote {path}")
    return 0


def measure_figures(
    names: tuple[str, ...], sizes: dict, out: Path, work: Path | None, device: str | None, keep_others: bool
) -> tuple[Path, ...]:
    """Measure ``names`` one after the other, writing results.json and README.md into ``out`` after each.

    :param sizes: each figure's sizes (:data:`FULL` or :data:`SMOKE`).
    :param work: scratch directory (None: a temporary one, removed afterwards).
    :param device: where the gpu figure runs (None: CUDA where present, else it is skipped).
    :param keep_others: start from the existing results.json, so the figures not measured keep their values.
    :returns: the paths written.
    :rtype: tuple[Path, ...]
    """
    results_path = out / "results.json"
    results = read_json(results_path) if keep_others and results_path.is_file() else {}
    results |= _where()
    paths: tuple[Path, ...] = ()
    with tempfile.TemporaryDirectory(prefix="textsql-bench-") as scratch:
        work = work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        data_dir = prepare_data(work) if set(names) - {"prepare", "rendezvous", "constrained", "model-latency"} else ""
        for name in names:
            started = time.monotonic()
            logger.info("measuring %s", name)
            measured_at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())

            def save(figures: dict[str, dict], measured_at: str = measured_at) -> tuple[Path, Path]:
                # Written after every figure (and every part of a long one), so a failure later loses
                # nothing measured before it.
                results.update({key: {**figure, "measured_at": measured_at} for key, figure in figures.items()})
                results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
                results["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
                return write(results, out)

            paths = save(measure(name, sizes[name], data_dir, work, device, save))
            logger.info("%s took %.0f s", name, time.monotonic() - started)
    return paths


def _where() -> dict:
    """The machine and releases a bench runs on, and when it started."""
    return {
        "machine": describe_machine(),
        "releases": releases(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


# Benches with their own command line (``python -m bench NAME --help``): NAME -> the module whose main() runs it.
COMMANDS = {
    "compile-warmup": "bench.compile_warmup",
    "demo-seeds": "bench.demo_seeds",
    "host-cost": "bench.host_cost",
    "norms": "bench.norms",
    "pretrained-proxy": "bench.pretrained_proxy",
    "rate-scaling": "bench.rate_scaling",
    "setup-cost": "bench.setup_cost",
    "sliced-loss": "bench.sliced_loss",
    "time-to-accuracy": "bench.accuracy",
}


def main(argv: list[str] | None = None) -> int:
    """Measure, then write the results (or run one of :data:`COMMANDS`).

    :rtype: int
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    chosen = [*args.figures, *(args.only.split(",") if args.only else [])]
    names = tuple(name.strip() for name in chosen) or FIGURE_NAMES
    unknown = [name for name in names if name not in (*FIGURE_NAMES, gpu_quick.COMMAND)]
    if unknown:
        parser.error(f"unknown figure {unknown[0]!r}; pass --only with some of {', '.join(FIGURE_NAMES)}")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("worker", "tensorboard", "textsql", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.skip and gpu_quick.COMMAND not in names:
        parser.error(f"--skip leaves out arms of {gpu_quick.COMMAND}; the other figures are chosen with --only")
    if gpu_quick.COMMAND in names:
        if len(names) > 1:
            parser.error(f"{gpu_quick.COMMAND} runs alone; measure the other figures in another call")
        sizes = quick_arms.SMOKE if args.smoke else quick_arms.QuickSizes()
        try:
            sizes = dataclasses.replace(sizes, skip=frozenset(filter(None, (args.skip or "").split(","))))
            device = sizes.device(args.device)
        except ValueError as error:
            parser.error(str(error))
        budget = gpu_quick.Budget(args.budget_s, args.budget_start or psutil.Process().create_time())
        return measure_gpu_quick(sizes, device, args.out, args.work, budget)
    figure_sizes = SMOKE if args.smoke else FULL
    for path in measure_figures(names, figure_sizes, args.out, args.work, args.device, keep_others=bool(chosen)):
        print(f"wrote {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "figures",
        nargs="*",
        help=f"figures to measure among {', '.join(FIGURE_NAMES)} (default: all), or {gpu_quick.COMMAND} alone",
    )
    parser.add_argument("--only", help="the same as comma-separated figures")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="where the gpu figure runs (default: cuda where present, else it is skipped); cpu runs every part on the CPU",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="smallest sizes: checks the code paths, measures nothing useful"
    )
    parser.add_argument(
        "--out", type=Path, default=BENCH_DIR, help="where results.json and README.md go (default: bench/)"
    )
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--budget-s", type=float, help=f"{gpu_quick.COMMAND}: seconds the whole device run may take")
    parser.add_argument(
        "--skip",
        metavar="ARM[,ARM]",
        help=f"{gpu_quick.COMMAND}: arms left out, among {', '.join(quick_arms.SKIPPABLE)} (compile: both compile arms)",
    )
    parser.add_argument(
        "--budget-start",
        type=float,
        help="when that run began, in seconds since the epoch (default: this process's start)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
