"""``python -m bench gpu-quick`` (``make bench-gpu``): the old recipe against the defaults on t5-small, sized to
take minutes on one GPU.

Every arm trains a model of t5-small's shape (``textsql/assets/t5-small``, random weights) on WikiSQL-shaped data
(:mod:`bench.fullscale`) with the full-vocabulary loss, for ``warmup_steps + timed_steps`` steps (30 + 200):

- ``old_recipe`` (:mod:`bench.old_recipe`), in this process: eager, fp32, batch 32 padded to 96, plain AdamW;
- ``defaults`` (:mod:`bench.ours`): ``textsql launch`` on 1 rank with no flag but ``--loss_vocabulary full``
  and ``--report_to none`` (TensorBoard's package is not among the wheels bench/device.sh installs on a GPU
  machine without network; the run logs every 10 steps either way), so on CUDA the profile ``auto`` picks,
  bf16, fused AdamW, TF32 and the token budget for the GPU's memory;
- on a GPU, the same with torch.compile turned the other way (``defaults_compiled``, or ``defaults_eager`` where
  the defaults compile), last. Both see the same batches step for step, so :func:`compile_price` gives what
  compiling costs in wall seconds, what it saves a step, and the steps after which it pays. The compiled rank runs
  under ``TORCH_LOGS=recompiles``, and :func:`recompilations` counts the recompilations with the guard that failed.

Samples/s (and real tokens/s: each sample's input and labels at their own lengths) is taken inside each training
process between the end of the last warm-up step and the end of the last step (:class:`bench.steps.StepClock`,
which waits for the GPU before each read). The first compilation falls in the warm-up; a recompilation can fall
in the timed window, and ``slowest_step_s`` beside ``median_step_s`` shows it. MFU counts each sample's FLOPs at
the lengths it trains at, the full output layer included (:mod:`bench.flops`); peak memory is torch's high-water
mark of allocated CUDA memory (on a CPU, peak RSS). One JSON (``gpu_quick.json`` in ``--out``), written after each
arm, with ``process_wall_s`` (from the process's start) at the end, and a table on stdout.

What a whole run takes on a GPU is its JSON's ``process_wall_s``; the compiled arm's ``wall_s`` is most of it.

``--device cpu --smoke`` runs the same code with the embedded small T5, a few steps and a small token budget
(tests/test_bench_gpu.py), without the GPU-only arm.

Whatever happens, the scratch directory's logs (the ranks' ``bench.log``, the launcher's) are copied into
``--out``'s ``logs/`` (:func:`keep_logs`): a compile error on the GPU comes back with the results. After each arm a
line says how much of the device run's budget is spent (:class:`Budget`; ``bench/device.sh`` passes its own).
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.flops import FLOP_CONVENTION, mfu
from bench.fullscale import WIKISQL_TRAIN_QUESTIONS
from bench.old_recipe import (
    LOSS_VOCABULARY,
    OLD_BATCH,
    mean_sample_flops,
    mean_sample_tokens,
    old_recipe,
    trained_examples,
)
from bench.old_recipe import label as old_label
from bench.ours import available, launch_ours, peak_memory, probe_record, run_summary, step_samples, throughput
from bench.steps import StepClock, step_times, timed_window
from bench.timing import rounded
from bench.workload import Workload, versions
from textsql.planning.device_defaults import device_facts, fast_defaults

logger = logging.getLogger(__name__)

COMMAND = "gpu-quick"
RESULT_NAME = "gpu_quick.json"
GIB = 1024**3
# "defaults" is what textsql picks on the machine; the other two run the defaults with torch.compile turned the
# other way (on a GPU only): the one that differs from "defaults" runs.
ARMS = ("old_recipe", "defaults", "defaults_eager", "defaults_compiled")
LOGS = "logs"
# torch.compile logs each recompilation with the guard that failed: the compiled arm's rank log keeps them.
RECOMPILE_LOGGING = {"TORCH_LOGS": "recompiles"}
RECOMPILING = "Recompiling function"
GUARD_FAILED = re.compile(r"\[__recompiles\]\s+- (?P<guard>\S.*)$")
REASONS_KEPT, REASON_CHARS = 10, 300
# The end of each log that comes back: a rank's traceback and a compile error's last lines are at the end, and what
# comes back from a GPU machine without network is often bounded in size.
LOG_TAIL_BYTES = 1024**2


@dataclass(frozen=True)
class Budget:
    """The time of the whole device run: ``seconds`` it may take (None: unbounded), from ``began`` (``time.time()``)."""

    seconds: float | None
    began: float

    def spent(self, now: float | None = None) -> str:
        """``123 s of the 460 s budget`` (``123 s`` without one).

        :rtype: str
        """
        elapsed = (time.time() if now is None else now) - self.began
        return f"{elapsed:.0f} s" + ("" if self.seconds is None else f" of the {self.seconds:.0f} s budget")


def keep_logs(work: Path, out: Path) -> list[Path]:
    """Copy every ``*.log`` under ``work`` (the ranks' and the launcher's) into ``out/logs``, keeping where each lay
    and only its last :data:`LOG_TAIL_BYTES`.

    :returns: the copies.
    :rtype: list[pathlib.Path]
    """
    kept = []
    for log in sorted(work.rglob("*.log")):
        copy = out / LOGS / log.relative_to(work)
        copy.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "rb") as source, open(copy, "wb") as target:
            source.seek(max(0, log.stat().st_size - LOG_TAIL_BYTES))
            shutil.copyfileobj(source, target)
        kept.append(copy)
    return kept


@dataclass(frozen=True)
class QuickSizes:
    """How much work ``gpu-quick`` does."""

    # Left out of samples/s: the compilation, and the allocator's and cuBLAS's first choices.
    warmup_steps: int = 30
    timed_steps: int = 200
    questions: int = WIKISQL_TRAIN_QUESTIONS
    tiny_model: bool = False  # the embedded small T5 instead of t5-small's shape
    old_batch: int = OLD_BATCH  # the old recipe's batch (smaller only in the smoke run)
    token_budget: int | None = None  # None: the defaults' own for the GPU (textsql.planning.device_defaults)

    def __post_init__(self) -> None:
        if self.warmup_steps < 1 or self.timed_steps < 1:
            raise ValueError(f"warmup_steps and timed_steps must be >= 1, got {self.warmup_steps}, {self.timed_steps}")

    def device(self, asked: str | None) -> str:
        """The device to run on: ``asked``, else CUDA where present.

        :raises ValueError: no CUDA and none asked, or a full-size run on the CPU (the defaults have no token
            budget there), naming the fix.
        :rtype: str
        """
        device = asked or ("cuda" if available() else None)
        if device is None or (device == "cpu" and self.token_budget is None):
            raise ValueError(f"{COMMAND} at full size needs a CUDA GPU; pass --device cpu --smoke to rehearse it here")
        return device

    @property
    def steps(self) -> int:
        """Steps each arm trains.

        :rtype: int
        """
        return self.warmup_steps + self.timed_steps


# A few steps of the tiny T5 on 4,000 questions: every code path, in minutes on two shared CPU cores.
SMOKE = QuickSizes(warmup_steps=1, timed_steps=2, questions=4000, tiny_model=True, old_batch=4, token_budget=2048)


def run(
    data_dir: str,
    work: Path,
    sizes: QuickSizes = QuickSizes(),
    device: str = "cuda",
    save: Callable[[dict], None] = lambda result: None,
) -> dict:
    """Both arms; ``save`` gets the result so far after each.

    :param data_dir: a ``textsql prepare`` output in schema form.
    :param device: ``cuda``, or ``cpu`` with a ``token_budget`` (:meth:`QuickSizes.device`).
    :rtype: dict
    """
    started = time.monotonic()
    sizes.device(device)
    chosen = fast_defaults(device_facts())
    load = Workload.build(data_dir, work, device, sizes.tiny_model, sizes.questions)
    result: dict = {
        "figure": COMMAND,
        "device": load.device_name,
        "versions": versions(),
        "model": load.model_label,
        "data": load.describe_data(),
        "peak_flops": load.peak,
        "flop_convention": FLOP_CONVENTION,
        "arms": {},
    }
    old_rate, old = old_recipe_arm(load, sizes, started)
    result["arms"]["old_recipe"] = old
    save(result)
    samples, result["arms"]["defaults"] = defaults_arm(load, sizes, work, chosen)
    if device == "cuda":
        # The same batches with torch.compile turned the other way price it: what compiling costs, what it saves
        # a step, after how many steps it pays. Last: a run cut short keeps the other arms.
        save(result)
        flipped = not chosen.get("torch_compile", False)
        name = "defaults_compiled" if flipped else "defaults_eager"
        _, result["arms"][name] = defaults_arm(load, sizes, work, {**chosen, "torch_compile": flipped}, name)
    result |= {
        "value": round(samples / old_rate, 2),
        "unit": "x (samples/s of the defaults / the old recipe's, same device, same run)",
        **compile_price(result["arms"], sizes.steps),
        "wall_s": round(time.monotonic() - started, 1),
        "method": (
            f"one {load.device_name}; model {load.model_label}; {result['data']}; "
            f"every arm {sizes.steps} steps, samples/s between the ends of step {sizes.warmup_steps} and step "
            f"{sizes.steps} (StepClock in the training process); MFU against the peak {load.peak} FLOP/s; wall_s "
            "from the start of the figure (after the imports and preparing the sample; process_wall_s counts them); "
            "defaults_eager or defaults_compiled (on a GPU): the defaults with torch.compile turned the other way, "
            "the same batches step for step; recompilations: torch's TORCH_LOGS=recompiles lines in the compiled "
            "rank's log"
        ),
    }
    save(result)
    return result


def old_recipe_arm(load: Workload, sizes: QuickSizes, started: float) -> tuple[float, dict]:
    """The old recipe in this process.

    :param started: when the figure started (``time.monotonic``), which the arm's ``wall_s`` counts from.
    :returns: its samples/s, and its arm.
    :rtype: tuple[float, dict]
    """
    with tempfile.TemporaryDirectory(prefix="bench-gpu-quick-old-") as output:
        old = old_recipe(load.model, load.data, Path(output), StepClock(), sizes.steps, load.device, sizes.old_batch)
    steps, seconds = timed_window(old, sizes.warmup_steps)
    old_rate = steps * sizes.old_batch / seconds
    trained = trained_examples(load.data, sizes.steps, sizes.old_batch)
    old_flops = mean_sample_flops(load.shape, trained)
    return old_rate, {
        "label": old_label(sizes.old_batch),
        "samples_per_s": round(old_rate, 2),
        "real_tokens_per_s": round(old_rate * mean_sample_tokens(trained)),
        "mfu_real_tokens": rounded(mfu(old_rate * old_flops, 1.0, load.peak)),
        "peak_memory_gib": round(old["peak_memory_bytes"] / GIB, 3),
        "memory_measure": old["memory_measure"],
        "loss_vocabulary": LOSS_VOCABULARY,
        **step_times(old, sizes.warmup_steps),
        "wall_s": round(time.monotonic() - started, 1),
    }


def defaults_arm(
    load: Workload, sizes: QuickSizes, work: Path, chosen: dict, name: str = "defaults"
) -> tuple[float, dict]:
    """The defaults: ``textsql launch`` on one rank, with torch.compile as ``chosen`` says (passed on the command
    line when ``name`` is not ``defaults``).

    :param chosen: :func:`textsql.planning.device_defaults.fast_defaults` of this machine (``torch_compile`` turned for the
        other arms), for the arm's label.
    :returns: its samples/s, and its arm.
    :rtype: tuple[float, dict]
    """
    launched = time.monotonic()
    compiled = chosen.get("torch_compile", False)
    run_dir = launch_ours(
        work,
        "gpu-quick-" + name.replace("_", "-"),
        load.model,
        load.data,
        probe_env=RECOMPILE_LOGGING if compiled else None,
        max_steps=sizes.steps,
        eval_strategy="no",
        report_to="none",
        max_tokens_per_batch=sizes.token_budget,
        **({} if name == "defaults" else {"torch_compile": compiled}),
    )
    summary, record = run_summary(run_dir), probe_record(run_dir)
    budget = summary["token_budget"]["max_tokens_per_batch"]
    rates = throughput(record, step_samples(load.lengths, budget, load.shape, sizes.steps), sizes.warmup_steps)
    memory, measure = peak_memory(record)
    return rates.samples, {
        "label": (
            f"defaults: textsql launch --ranks 1, profile {summary['profile']} ({summary['profile_chosen_by']}), "
            f"{summary['precision']}, {'torch.compile' if compiled else 'eager'}, {chosen['optim']}, token budget "
            f"{budget}, --loss_vocabulary {LOSS_VOCABULARY}, --report_to none"
        ),
        "samples_per_s": round(rates.samples, 2),
        "real_tokens_per_s": round(rates.tokens),
        "mfu_real_tokens": rounded(mfu(rates.flops, 1.0, load.peak)),
        "peak_memory_gib": round(memory / GIB, 3),
        "memory_measure": measure,
        "loss_vocabulary": summary["loss_vocabulary"],
        **step_times(record, sizes.warmup_steps),
        "wall_s": round(time.monotonic() - launched, 1),
        "profile": summary["profile"],
        "precision": summary["precision"],
        "torch_compile": compiled,
        "token_budget": budget,
        **({"recompilations": recompilations(run_dir / "bench.log")} if compiled else {}),
    }


def recompilations(log: Path) -> dict:
    """How many times torch.compile compiled the model again during a run, and the first guard that failed each time
    (the first :data:`REASONS_KEPT`), from the rank's log under :data:`RECOMPILE_LOGGING`.

    :rtype: dict
    """
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    reasons = []
    for index, line in enumerate(lines):
        if RECOMPILING not in line:
            continue
        failed = (GUARD_FAILED.search(later) for later in lines[index + 1 : index + 4])
        guard = next((match["guard"] for match in failed if match), "")
        reasons.append(guard[:REASON_CHARS])
    return {"count": len(reasons), "first_guards_failed": reasons[:REASONS_KEPT]}


def compile_price(arms: dict, steps: int) -> dict:
    """What torch.compile cost against the same run eager, where both ran: the extra wall seconds, the median step's
    saving, and the steps after which a run compiled is done sooner than eager.

    :rtype: dict
    """
    by_compile = {arm["torch_compile"]: arm for name, arm in arms.items() if name != "old_recipe"}
    if set(by_compile) != {False, True}:
        return {}
    eager, compiled = by_compile[False], by_compile[True]
    extra_s = compiled["wall_s"] - eager["wall_s"]
    saved_s = eager["median_step_s"] - compiled["median_step_s"]
    return {
        "compile": {
            "extra_wall_s": round(extra_s, 1),
            "median_step_s_saved": round(saved_s, 4),
            "samples_per_s_over_eager": round(compiled["samples_per_s"] / eager["samples_per_s"], 2),
            # wall(n) = start-up + compilation + n x step: equal for both at n = steps + extra_s / saved_s.
            # Rounded first: float noise must not add a step (183 / 0.02 is 9150.000000000002).
            "break_even_steps": math.ceil(round(steps + extra_s / saved_s, 6)) if saved_s > 0 else None,
        }
    }


def table(result: dict) -> str:
    """The result as a markdown table, one row an arm, and the ratio below it.

    :rtype: str
    """
    versions = result["versions"]
    lines = [
        f"gpu-quick on {result['device']} (torch {versions['torch']}, CUDA {versions['cuda']}), model {result['model']}",
        "",
        "| arm | samples/s | real tokens/s | MFU | peak memory GiB | loss vocabulary | warm-up s | median step s |"
        + " slowest step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ARMS:
        arm = result["arms"].get(name)
        if arm is None:
            continue
        share = "n/a" if arm["mfu_real_tokens"] is None else f"{arm['mfu_real_tokens']:.2%}"
        lines.append(
            f"| {name} | {arm['samples_per_s']} | {arm['real_tokens_per_s']} | {share} | {arm['peak_memory_gib']} | "
            f"{arm['loss_vocabulary']} | "
            f"{arm['warmup_s']} | {arm['median_step_s']} | {arm['slowest_step_s']} |"
        )
    lines += ["", *(f"- {name}: {result['arms'][name]['label']}" for name in ARMS if name in result["arms"])]
    if "value" in result:
        lines += ["", f"defaults / old recipe: {result['value']}x samples/s; {result['wall_s']} s in all"]
    for name, arm in result["arms"].items():
        if "recompilations" in arm:
            lines.append(f"{name}: torch.compile compiled the model again {arm['recompilations']['count']} time(s)")
    price = result.get("compile")
    if price:
        pays = (
            "never, at these step times"
            if price["break_even_steps"] is None
            else f"after {price['break_even_steps']} steps"
        )
        lines.append(
            f"torch.compile: {price['extra_wall_s']} s more than eager over the run, {price['median_step_s_saved']} s "
            f"saved a step (median), {price['samples_per_s_over_eager']}x eager's samples/s; a run is done sooner "
            f"compiled {pays}"
        )
    return "\n".join(lines)
