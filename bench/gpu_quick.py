"""``python -m bench gpu-quick`` (``make bench-gpu``): the defaults against the peers a user would otherwise run, on
t5-small's shape and t5-base's, sized to fit one short lease of a GPU machine.

Every arm trains a model built from a shipped config (random weights) on WikiSQL-shaped data
(:mod:`bench.fullscale`) with the full-vocabulary loss, and is measured alike (:mod:`bench.quick_arms`: samples/s,
real tokens/s, MFU, peak memory, step times, and a timeline of a few steady steps from ``torch.profiler``). In the
order they run, the most telling first, so a run cut short keeps them:

- ``defaults``: ``textsql launch`` on 1 rank with no flag but ``--loss_vocabulary full`` and ``--report_to none``
  (TensorBoard's package is not among the wheels bench/device.sh installs), so on CUDA the profile ``auto`` picks,
  bf16, fused AdamW, TF32 and the token budget for the GPU's memory;
- ``peer``: a plain ``Seq2SeqTrainer`` tuned as transformers' docs advise (:mod:`bench.peer`), at the defaults'
  questions a step: the headline ``value`` is the defaults' samples/s over its;
- ``old_recipe``: the seed notebook's (:mod:`bench.old_recipe`): fp32, batch 32 padded to 96 (``defaults_over``
  keeps that ratio too);
- ``defaults_t5_base``: the defaults on t5-base's shape (``textsql/assets/t5-base``);
- ``norms`` (:mod:`bench.norms`, in ``norms``, not among the arms): training steps of t5-small's shape, and on a GPU
  t5-base's, with T5's own norms against torch's ``RMSNorm`` (:func:`textsql.model.speedups.fuse_norms`, which the
  defaults train with and the other arms do not), the kernels a step launches and its median time, in seconds of the
  budget;
- ``sliced_loss`` (:mod:`bench.sliced_loss`, in ``sliced_loss``, not among the arms): on the same shapes, the
  full-vocabulary loss with T5's logits (what the peer and the old recipe compute), in torch's own slices and in the
  defaults', each step's time and peak memory (the logits arm alone on a torch without ``linear_cross_entropy``);
- ``time_to_accuracy`` (:mod:`bench.accuracy`), where the budget holds it: the demo's task from scratch until
  held-out logical-form accuracy reaches 70 % or a time cap, the defaults against the peer;
- on a GPU, where :data:`DOUBLE_BUDGET_ARM_S` is left, ``defaults_double_budget``: the defaults at twice their token
  budget, whether more tokens a step than the GPU's memory sizes raise samples/s (what it does to accuracy a step
  needs a longer run than gpu-quick's);
- on a GPU, and only where the budget has :data:`COMPILE_ARM_S` left, the defaults with torch.compile turned the
  other way (``defaults_compiled``, or ``defaults_eager`` where the defaults compile), last: it compiles for
  minutes; then, where :data:`COMPILE_WARM_ARM_S` is left, ``defaults_compiled_warm``, compiled again with the
  compile cache the first left (what a user's second run pays; :mod:`textsql.training.compiling` keeps the cache
  across runs); then, where :data:`COMPILE_GRAPHS_ARM_S` is left, ``defaults_compiled_graphs``, compiled with
  ``--torch-compile-mode reduce-overhead``, which replays each compiled region's kernels as one CUDA graph: on one
  H200 the eager defaults' GPU was busy under half of a step, waiting on the host's launches, which a graph does
  away with. :func:`bench.quick_report.compile_price` gives what compiling costs in wall seconds, what it saves
  a step, and the steps after which it pays (a compiled run's sampler gives each bucket one shape,
  :mod:`textsql.training.batching`, so its batches differ a little from eager's). The compiled rank runs under
  ``TORCH_LOGS=recompiles,cudagraphs``, which :func:`bench.quick_arms.recompilations` and, for the CUDA-graphs
  arm, :func:`bench.quick_arms.graphs_skipped` count, and its step clock counts the graphs compiled after the
  warm-up (``compilations_after_warmup``).

``--skip ARM[,ARM]`` leaves arms out (:data:`bench.quick_arms.SKIPPABLE`: ``compile`` is every compile arm,
``compile_graphs`` the CUDA-graphs one), so a
second short lease can measure what the first had no time left for, e.g. ``QUICK_ARGS="--skip
time_to_accuracy,defaults_t5_base"``. One JSON (``gpu_quick.json`` in ``--out``), written after each arm with the ratios known so far, with
``process_wall_s`` (from the process's start) at the end, and a table on stdout (:mod:`bench.quick_report`).

``--device cpu --smoke`` runs the same code with the embedded small T5 for every arm, a few steps and a small token
budget (tests/test_bench_checkout.py), without the GPU-only arm.

Whatever happens, the scratch directory's logs (the ranks' ``bench.log``, the launcher's) are copied into
``--out``'s ``logs/`` (:func:`keep_logs`): a compile error on the GPU comes back with the results. After each arm a
line says how much of the device run's budget is spent (:class:`Budget`; ``bench/device.sh`` passes its own).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.accuracy import time_to_accuracy
from bench.flops import FLOP_CONVENTION
from bench.norms import measure as measure_norms
from bench.profiles import T5_BASE_CONFIG
from bench.quick_arms import CUDA_GRAPHS_MODE, QuickSizes, defaults_arm, old_recipe_arm, peer_arm
from bench.quick_report import compile_price, ratios
from bench.sliced_loss import measure as measure_sliced_loss
from bench.workload import Workload, versions
from textsql.planning.device_defaults import device_facts, fast_defaults

logger = logging.getLogger(__name__)

COMMAND = "gpu-quick"
RESULT_NAME = "gpu_quick.json"
LOGS = "logs"
# The end of each log that comes back: a rank's traceback and a compile error's last lines are at the end, and what
# comes back from a GPU machine without network is often bounded in size.
LOG_TAIL_BYTES = 1024**2
# What the compile arm needs of the budget: on one H200 it took 227 s (bench/gpu_quick.json), most of it compiling
# the whole model; the warm one, with the compile cache the first left, about what an eager arm takes and its loading.
COMPILE_ARM_S = 240
COMPILE_WARM_ARM_S = 90
# The CUDA-graphs arm compiles afresh (the mode is part of what the cache is keyed by), by regions; not yet run on a
# GPU.
COMPILE_GRAPHS_ARM_S = 150
# The defaults' arm took 43.9 s on one H200 (bench/gpu_quick.json); twice the tokens a step, a little more.
DOUBLE_BUDGET_ARM_S = 75


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

    def left(self, now: float | None = None) -> float:
        """Seconds left (infinite without a budget).

        :rtype: float
        """
        if self.seconds is None:
            return math.inf
        return self.seconds - ((time.time() if now is None else now) - self.began)

    def short_of(self, needs: float, now: float | None = None) -> str | None:
        """Why a part that needs ``needs`` seconds cannot run now (its line in ``skipped``), or None where it can.

        :rtype: str | None
        """
        left = self.left(now)
        return f"{left:.0f} s of the budget left, {needs:.0f} s needed" if left < needs else None


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


def run(
    data_dir: str,
    work: Path,
    sizes: QuickSizes,
    device: str = "cuda",
    save: Callable[[dict], None] = lambda result: None,
    budget: Budget = Budget(None, 0.0),
) -> dict:
    """Every arm in turn; ``save`` gets the result so far after each.

    :param data_dir: a ``textsql prepare`` output in schema form.
    :param device: ``cuda``, or ``cpu`` with a ``token_budget`` (:meth:`QuickSizes.device`).
    :param budget: the device run's; the compile arm runs only where :data:`COMPILE_ARM_S` of it is left.
    :rtype: dict
    """
    started = time.monotonic()
    sizes.device(device)
    chosen = fast_defaults(device_facts())
    load = Workload.build(data_dir, work, device, sizes.tiny_model, sizes.questions)
    # done: the arms and parts done, in order
    result: dict = {**heading(load), "arms": {}, "skipped": {}, "done": []}

    def done(name: str, figure: dict, arm: bool = True) -> dict:
        (result["arms"] if arm else result)[name] = figure
        result["done"].append(name)
        result.update(ratios(result["arms"]))
        save(result)
        return figure

    def wanted(name: str) -> bool:
        if name in sizes.skip:
            result["skipped"][name] = "left out (--skip)"
        return name not in sizes.skip

    ours = done("defaults", defaults_arm(load, sizes, work, chosen))
    if wanted("peer"):
        done("peer", peer_arm(load, sizes, ours["token_budget"]))
    if wanted("old_recipe"):
        done("old_recipe", old_recipe_arm(load, sizes))
    if wanted("defaults_t5_base"):
        t5_base = load.shaped_as(T5_BASE_CONFIG, work)
        done("defaults_t5_base", defaults_arm(t5_base, sizes, work, chosen, "defaults_t5_base"))
    for part, measure in (("norms", measure_norms), ("sliced_loss", measure_sliced_loss)):
        if wanted(part):
            done(part, measure(getattr(sizes, part), device, part_models(load, work, device)), arm=False)
    if wanted("time_to_accuracy"):
        accuracy_arms(device, sizes, work, budget, result, save)
    if device == "cuda" and wanted("defaults_double_budget"):
        double_budget_arm(load, sizes, work, chosen, 2 * ours["token_budget"], budget, result["skipped"], done)
    if device == "cuda" and wanted("compile"):
        compile_arms(load, sizes, work, chosen, budget, result["skipped"], done)
    result |= {
        **compile_price(result["arms"], sizes.steps),
        "wall_s": round(time.monotonic() - started, 1),
        "method": method(load, sizes),
    }
    save(result)
    return result


def heading(load: Workload) -> dict:
    """What the JSON says first: the figure, the GPU and releases, the model, the data and the FLOP count's basis.

    :rtype: dict
    """
    return {
        "figure": COMMAND,
        "device": load.device_name,
        "versions": versions(),
        "model": load.model_label,
        "data": load.describe_data(),
        "peak_flops": load.peak,
        "flop_convention": FLOP_CONVENTION,
    }


def compile_arms(
    load: Workload,
    sizes: QuickSizes,
    work: Path,
    chosen: dict,
    budget: Budget,
    skipped: dict,
    done: Callable[[str, dict], dict],
) -> None:
    """The defaults with torch.compile turned the other way, which prices it; last, since it compiles for minutes.
    Compiling where the defaults do not, a second compiled run with the cache the first left prices a second run.
    Then, unless ``--skip compile_graphs``, a compiled run replaying its regions as CUDA graphs
    (``defaults_compiled_graphs``): what the host's launches cost the eager step. Each runs only where the budget
    holds it (else it is in ``skipped``); ``done`` keeps each arm run."""
    flipped = not chosen.get("torch_compile", False)
    # (name, seconds it needs, compiled, --torch-compile-mode)
    arms: list[tuple[str, float, bool, str | None]] = (
        [("defaults_compiled", COMPILE_ARM_S, True, None), ("defaults_compiled_warm", COMPILE_WARM_ARM_S, True, None)]
        if flipped
        else [("defaults_eager", COMPILE_ARM_S, False, None)]
    )
    if "compile_graphs" in sizes.skip:
        skipped["defaults_compiled_graphs"] = "left out (--skip)"
    else:
        arms.append(("defaults_compiled_graphs", COMPILE_GRAPHS_ARM_S, True, CUDA_GRAPHS_MODE))
    for name, needs, compiled, mode in arms:
        short = budget.short_of(needs)
        if name == "defaults_compiled_warm" and "defaults_compiled" in skipped:
            short = "no compiled arm left it a compile cache"
        if short:
            skipped[name] = short
            continue
        done(name, defaults_arm(load, sizes, work, chosen, name, compiled, mode))


def part_models(load: Workload, work: Path, device: str) -> list[Path]:
    """The models the norms and sliced-loss parts run: the defaults', and on a GPU t5-base's shape too (seconds
    there, minutes on a CPU).

    :rtype: list[pathlib.Path]
    """
    return [load.model, *([load.shaped_as(T5_BASE_CONFIG, work).model] if device == "cuda" else [])]


def double_budget_arm(
    load: Workload,
    sizes: QuickSizes,
    work: Path,
    chosen: dict,
    token_budget: int,
    budget: Budget,
    skipped: dict,
    done: Callable[[str, dict], dict],
) -> None:
    """The defaults at ``token_budget`` (twice their own) where the budget holds it: whether a larger budget than the
    GPU's memory sizes raises samples/s, on a GPU whose memory the defaults leave mostly unused."""
    name = "defaults_double_budget"
    if short := budget.short_of(DOUBLE_BUDGET_ARM_S):
        skipped[name] = short
        return
    done(name, defaults_arm(load, dataclasses.replace(sizes, token_budget=token_budget), work, chosen, name))


def accuracy_arms(
    device: str, sizes: QuickSizes, work: Path, budget: Budget, result: dict, save: Callable[[dict], None]
) -> None:
    """The time-to-accuracy figure into ``result["time_to_accuracy"]``, saved after each of its arms; skipped where
    the budget has less left than it needs."""
    if short := budget.short_of(sizes.accuracy.needs_s):
        result["skipped"]["time_to_accuracy"] = short
        return

    def keep(figure: dict) -> None:
        result["time_to_accuracy"] = figure
        result["done"].append(f"time_to_accuracy {list(figure['arms'])[-1]}")
        save(result)

    time_to_accuracy(device, sizes.accuracy, work, sizes.token_budget, save=keep)


def method(load: Workload, sizes: QuickSizes) -> str:
    """How the figure was measured, for its JSON.

    :rtype: str
    """
    return (
        f"one {load.device_name}; model {load.model_label} (defaults_t5_base: t5-base's shape); "
        f"{load.describe_data()}; "
        f"every arm {sizes.steps} steps, samples/s between the ends of step {sizes.warmup_steps} and step "
        f"{sizes.steps} (StepClock in the training process), then {sizes.timeline_steps} steps profiled with "
        "torch.profiler (timeline: busy_fraction is the union of the device's activity over the window's wall "
        f"time); MFU against the peak {load.peak} FLOP/s; each arm's wall_s from its start to its end; "
        "peer: its batch is the defaults' mean questions a step at their token budget; time_to_accuracy: the demo's "
        "task, both arms evaluated alike (bench/accuracy.py); defaults_double_budget (on a GPU): the defaults at "
        "twice their token budget; norms and sliced_loss: bench/norms.py and bench/sliced_loss.py on the defaults' "
        "model (and t5-base's shape on a GPU); "
        "defaults_eager or defaults_compiled (on a GPU): the "
        "defaults with torch.compile turned the other way (compiled: one batch shape a bucket), defaults_compiled_warm "
        "the same with the compile cache the first left, defaults_compiled_graphs compiled with --torch-compile-mode "
        "reduce-overhead (CUDA graphs); recompilations and cuda_graphs_skipped: torch's "
        "TORCH_LOGS=recompiles,cudagraphs lines in the compiled rank's log; compilations_after_warmup: dynamo's graphs "
        "compiled after the warm-up steps"
    )
