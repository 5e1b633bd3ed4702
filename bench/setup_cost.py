"""What setting up costs: a fresh virtual environment's install of requirements.txt, and the demo's peak memory.

``python -m bench.setup_cost`` writes ``bench/setup_cost.json``; docs/getting-started.md shows its figures.
The install runs ``python3 -m venv`` then ``pip install -r requirements.txt`` in a new temporary directory, with
this machine's pip settings (its index and wheel cache: a first install over a slow network takes longer). The
demo runs as ``make demo`` runs it, from a scratch directory; its peak memory is the largest sum of the proportional
set sizes of all its processes (master, kernels, worker pods, ranks), sampled, and its summary is kept whole
(docs/getting-started.md shows it). Its scores are kept too (:func:`demo_scores`): what the demo's recipe learns in
its step budget, beside its wall time, so a change to the data, model or schedule is measured the same way. With
``--baseline REVISION`` the demo of that commit runs right after, the same way, and ``baseline`` keeps its times,
scores and ``demo_time_ratio`` (this demo's wall time over the baseline's).
``python -m bench setup-cost`` runs it too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from bench.machine import describe_machine, releases
from textsql.constants import METRICS_NAME, PREDICTIONS_NAME, REAL_METRICS_NAME
from textsql.json_files import read_json, read_jsonl, write_json

BENCH_DIR = Path(__file__).resolve().parent
PROJECT_DIR = BENCH_DIR.parent
RESULT = BENCH_DIR / "setup_cost.json"
SUMMARY = BENCH_DIR / "demo_summary.txt"  # the demo's summary as printed, included by docs/getting-started.md
GIB = 1024**3
# The summary's "Time:" lines: "  02_train_distributed     366.0 s".
NOTEBOOK_TIME = re.compile(r"^  (0\d_\w+) +([\d.]+) s$", re.MULTILINE)
# Reading a process's proportional set size walks its pages in the kernel: every half second, for the ranks, kernels
# and pods, that took 9 % of a core from the two the demo trains on, and slowed the demo it measured.
SAMPLE_S = 2.0


def directory_bytes(path: Path) -> int:
    """The bytes of the files under ``path``, links not followed."""
    return sum(entry.lstat().st_size for entry in path.rglob("*") if entry.is_file() and not entry.is_symlink())


def measure_install(work: Path) -> dict:
    """Time ``python3 -m venv`` plus ``pip install -r requirements.txt`` into ``work``, and weigh the result."""
    venv = work / "venv"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "-r", str(PROJECT_DIR / "requirements.txt")],
        check=True,
        cwd=PROJECT_DIR,
    )
    return {
        "command": "python3 -m venv V && V/bin/pip install -r requirements.txt",
        "wall_s": round(time.monotonic() - started, 1),
        "venv_gib": round(directory_bytes(venv) / GIB, 2),
    }


def tree_memory(process: psutil.Process) -> int:
    """The memory ``process`` and all its descendants hold now, in bytes: the sum of their proportional set sizes
    (a page shared by n processes counts 1/n in each, so torch's libraries count once); those that end meanwhile
    count nothing."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += member.memory_full_info().pss
    return total


def measure_demo(
    work: Path, steps: int | None, code: Path = PROJECT_DIR, seed: int | None = None, params: Sequence[str] = ()
) -> dict:
    """Run ``textsql demo --run-dir runs/demo`` from ``work`` (``steps`` optimizer steps, or the demo's own; training
    ``seed``, or notebook 02's; more ``-p NAME=VALUE`` from ``params``) with the package of the checkout ``code``: its
    wall time, the summary it printed, and
    its peak memory (:func:`tree_memory` of the command: the master, the notebooks' kernels, the local worker pods and
    their ranks), sampled every :data:`SAMPLE_S` seconds."""
    chosen = ([f"max_steps={steps}"] if steps else []) + ([f"seed={seed}"] if seed is not None else []) + list(params)
    command = [str(Path(sys.executable).parent / "textsql"), "demo", "--run-dir", "runs/demo"]
    command += [option for value in chosen for option in ("-p", value)]
    # Ahead of the installed package: the launch hands the package's own checkout to the ranks (their PYTHONPATH).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    demo = psutil.Popen(command, cwd=work, stdout=subprocess.PIPE, text=True, env=env)
    peak = 0
    while demo.poll() is None:
        peak = max(peak, tree_memory(demo))
        time.sleep(SAMPLE_S)
    printed = demo.stdout.read() if demo.stdout else ""
    if demo.returncode:
        raise SystemExit(f"the demo failed with exit code {demo.returncode}:\n{printed[-3000:]}")
    summary = printed[printed.index("Everything is under") :].replace(str(Path(sys.executable).parent), ".venv/bin")
    summary = summary.replace(f"{work}/", "")  # the demo's paths as a reader's `make demo` in the project shows them
    return {
        "command": " ".join(["textsql demo", *(f"-p {value}" for value in chosen)]),
        "wall_s": round(time.monotonic() - started, 1),
        "scores": demo_scores(work / "runs" / "demo"),
        "notebook_s": {name: float(seconds) for name, seconds in NOTEBOOK_TIME.findall(summary)},
        "peak_memory_gib": round(peak / GIB, 2),
        "peak_memory_sampled_every_s": SAMPLE_S,
        "summary": summary,
    }


def demo_scores(run_dir: Path) -> dict:
    """The held-out synthetic scores of a demo's run directory, each accuracy with its standard error, and the real
    questions' select accuracy beside its baseline (``metrics.json``, ``real_metrics.json``)."""

    def scores(name: str) -> dict:
        metrics = read_json(run_dir / name)
        kept = ("n", "lf_accuracy", "lf_standard_error", "ex_accuracy", "ex_standard_error")
        return {key: metrics.get(key) for key in kept} | {
            "tables": len({line["table_id"] for line in read_jsonl(run_dir / PREDICTIONS_NAME)})
            if name == METRICS_NAME
            else None,
            "select": metrics["components"]["sel"],
            "where": metrics["components"]["where"],
            "select_baseline": metrics["baseline"]["components"]["sel"],
        }

    return {"held_out_synthetic": scores(METRICS_NAME), "real": scores(REAL_METRICS_NAME)}


def measure_baseline(work: Path, revision: str, steps: int | None) -> dict:
    """The demo of commit ``revision`` (a worktree of this repository), run as :func:`measure_demo` runs this one,
    right after it on the same machine: the times to compare with, without which a demo's time says little."""
    commit = subprocess.run(
        ["git", "-C", str(PROJECT_DIR), "rev-parse", "--short", revision], check=True, capture_output=True, text=True
    ).stdout.strip()
    checkout = work / f"baseline-{commit}"
    subprocess.run(["git", "-C", str(PROJECT_DIR), "worktree", "add", "--detach", str(checkout), commit], check=True)
    try:
        demo = measure_demo(work / "baseline-demo", steps, code=checkout)
    finally:
        subprocess.run(["git", "-C", str(PROJECT_DIR), "worktree", "remove", "--force", str(checkout)], check=False)
    kept = ("command", "wall_s", "notebook_s", "peak_memory_gib")
    return {"commit": commit, **{key: demo[key] for key in kept}, "scores": demo["scores"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="the demo's optimizer steps (default: its own)")
    parser.add_argument("--skip-install", action="store_true", help="keep the install figures already written")
    parser.add_argument(
        "--baseline", metavar="REVISION", help="also run this commit's demo after this one's, and compare their times"
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="setup-cost-"))
    baseline = None
    try:
        install = None if args.skip_install else measure_install(work)
        demo = measure_demo(work, args.steps)
        if args.baseline:
            baseline = measure_baseline(work, args.baseline, args.steps)
            baseline["demo_time_ratio"] = round(demo["wall_s"] / baseline["wall_s"], 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    previous = json.loads(RESULT.read_text()) if args.skip_install and RESULT.exists() else {}
    write_json(
        RESULT,
        {
            "machine": describe_machine(),
            "releases": releases(),
            "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "install": install or previous.get("install"),
            "demo": demo,
            "baseline": baseline,
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
    )
    SUMMARY.write_text(demo["summary"])
    print(RESULT.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
