"""The arms of ``gpu-quick`` (:mod:`bench.gpu_quick`), each trained and measured alike, and how much they train.

Every arm trains ``warmup_steps + timed_steps`` steps, then ``timeline_steps`` more under
:class:`bench.timeline.Timeline`: samples/s, MFU and step times come from the clock between the end of the last
warm-up step and the end of the last timed step (:class:`bench.steps.StepClock`), which the profiled steps after it
cannot slow; the timeline comes from those. MFU counts each sample's FLOPs at the lengths it trains at, the full
output layer included (:mod:`bench.flops`); peak memory is torch's high-water mark of allocated CUDA memory (on a
CPU, peak RSS).

- :func:`defaults_arm`: ``textsql launch`` on one rank (:mod:`bench.ours`), the rank profiled through
  :mod:`bench.rank_probe`;
- :func:`peer_arm`: the plain ``Seq2SeqTrainer`` tuned as transformers' docs advise (:mod:`bench.peer`), in this
  process, at the defaults' questions a step;
- :func:`old_recipe_arm`: the seed notebook's recipe (:mod:`bench.old_recipe`), in this process.
"""

from __future__ import annotations

import logging
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.accuracy import ACCURACY_SMOKE, AccuracySizes
from bench.flops import mfu
from bench.fullscale import WIKISQL_TRAIN_QUESTIONS
from bench.norms import SMOKE as NORMS_SMOKE
from bench.norms import NormSizes
from bench.old_recipe import (
    LOSS_VOCABULARY,
    OLD_BATCH,
    mean_sample_flops,
    mean_sample_tokens,
    old_recipe,
    trained_examples,
)
from bench.old_recipe import label as old_label
from bench.ours import (
    StepWork,
    available,
    launch_ours,
    peak_memory,
    probe_record,
    run_summary,
    step_samples,
    throughput,
)
from bench.peer import label as peer_label
from bench.peer import peer_batch, peer_recipe
from bench.rank_probe import TIMELINE_VAR
from bench.sliced_loss import SMOKE as SLICED_LOSS_SMOKE
from bench.sliced_loss import LossSizes
from bench.steps import StepClock, compilations_after, step_times, timed_window
from bench.timeline import Timeline
from bench.timing import rounded
from bench.workload import Workload
from textsql.training.compiling import CACHE_VAR

logger = logging.getLogger(__name__)

GIB = 1024**3
# torch.compile logs each recompilation with the guard that failed, and under CUDA graphs each region it leaves out
# of them with the reason: the compiled arm's rank log keeps them.
RECOMPILE_LOGGING = {"TORCH_LOGS": "recompiles,cudagraphs"}
CUDA_GRAPH_SKIPPED = "skipping cudagraphs due to "
COMPILE_CACHE = "compile-cache"
RECOMPILING = "Recompiling function"
GUARD_FAILED = re.compile(r"\[__recompiles\]\s+- (?P<guard>\S.*)$")
REASONS_KEPT, REASON_CHARS = 10, 300


# What gpu-quick --skip may leave out: every arm but the defaults, which the others are compared with.
SKIPPABLE = (
    "peer",
    "old_recipe",
    "defaults_t5_base",
    "norms",
    "sliced_loss",
    "time_to_accuracy",
    "defaults_double_budget",
    "compile",
    "compile_graphs",
)
# torch.compile's mode that replays each compiled region's kernels as CUDA graphs, one launch for all of them.
CUDA_GRAPHS_MODE = "reduce-overhead"


@dataclass(frozen=True)
class QuickSizes:
    """How much work ``gpu-quick`` does."""

    # Left out of samples/s: the compilation, and the allocator's and cuBLAS's first choices.
    warmup_steps: int = 30
    timed_steps: int = 200
    timeline_steps: int = 3  # profiled after the timed window (bench.timeline)
    questions: int = WIKISQL_TRAIN_QUESTIONS
    tiny_model: bool = False  # the embedded small T5 instead of t5-small's (and t5-base's) shape
    old_batch: int = OLD_BATCH  # the old recipe's batch (smaller only in the smoke run)
    token_budget: int | None = None  # None: the defaults' own for the GPU (textsql.planning.device_defaults)
    accuracy: AccuracySizes = field(default_factory=AccuracySizes)  # the time-to-accuracy figure's (bench.accuracy)
    norms: NormSizes = field(default_factory=NormSizes)  # T5's norms against torch's RMSNorm (bench.norms)
    sliced_loss: LossSizes = field(default_factory=LossSizes)  # the loss with and without logits (bench.sliced_loss)
    skip: frozenset[str] = frozenset()  # arms of SKIPPABLE left out (gpu-quick --skip): a lease spent elsewhere

    def __post_init__(self) -> None:
        if self.warmup_steps < 1 or self.timed_steps < 1 or self.timeline_steps < 1:
            raise ValueError(
                "warmup_steps, timed_steps and timeline_steps must be >= 1, got "
                f"{self.warmup_steps}, {self.timed_steps}, {self.timeline_steps}"
            )
        unknown = sorted(self.skip - set(SKIPPABLE))
        if unknown:
            raise ValueError(f"--skip {unknown[0]}: no such arm; pass some of {', '.join(SKIPPABLE)}")

    def device(self, asked: str | None) -> str:
        """The device to run on: ``asked``, else CUDA where present.

        :raises ValueError: no CUDA and none asked, or a full-size run on the CPU (the defaults have no token
            budget there), naming the fix.
        :rtype: str
        """
        device = asked or ("cuda" if available() else None)
        if device is None or (device == "cpu" and self.token_budget is None):
            raise ValueError("gpu-quick at full size needs a CUDA GPU; pass --device cpu --smoke to rehearse it here")
        return device

    @property
    def steps(self) -> int:
        """Steps each arm is timed over (warm-up and timed).

        :rtype: int
        """
        return self.warmup_steps + self.timed_steps

    @property
    def trained_steps(self) -> int:
        """Steps each arm trains: the timed ones, then the profiled ones.

        :rtype: int
        """
        return self.steps + self.timeline_steps

    @property
    def timeline(self) -> str:
        """The profiled steps as ``FIRST,STEPS`` (:data:`bench.rank_probe.TIMELINE_VAR`).

        :rtype: str
        """
        return f"{self.steps + 1},{self.timeline_steps}"

    def timed(self, record: dict) -> dict:
        """A clock record cut to the timed steps (the profiled ones after them left out).

        :rtype: dict
        """
        return {
            **record,
            "step_began": record["step_began"][: self.steps],
            "step_ended": record["step_ended"][: self.steps],
        }


# A few steps of the tiny T5 on 4,000 questions: every code path, in minutes on two shared CPU cores.
SMOKE = QuickSizes(
    warmup_steps=1,
    timed_steps=2,
    timeline_steps=1,
    questions=4000,
    tiny_model=True,
    old_batch=4,
    token_budget=2048,
    accuracy=ACCURACY_SMOKE,
    norms=NORMS_SMOKE,
    sliced_loss=SLICED_LOSS_SMOKE,
)


def figures(load: Workload, sizes: QuickSizes, record: dict, rates: StepWork, memory: tuple[int, str]) -> dict:
    """What every arm reports: rates, MFU, peak memory, step times, the timeline.

    :param record: the arm's clock record, the profiled steps included.
    :param rates: samples/s, real FLOP/s and real tokens/s over the timed window.
    :param memory: peak bytes and how they were read.
    :rtype: dict
    """
    return {
        "samples_per_s": round(rates.samples, 2),
        "real_tokens_per_s": round(rates.tokens),
        "mfu_real_tokens": rounded(mfu(rates.flops, 1.0, load.peak)),
        "peak_memory_gib": round(memory[0] / GIB, 3),
        "memory_measure": memory[1],
        **step_times(sizes.timed(record), sizes.warmup_steps),
        "timeline": record.get("timeline"),
    }


def old_recipe_arm(load: Workload, sizes: QuickSizes) -> dict:
    """The old recipe in this process.

    :rtype: dict
    """
    began = time.monotonic()
    timeline = Timeline(sizes.steps + 1, sizes.timeline_steps)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-quick-old-") as output:
        old = old_recipe(
            load.model,
            load.data,
            Path(output),
            StepClock(),
            sizes.trained_steps,
            load.device,
            sizes.old_batch,
            callbacks=(timeline,),
            # The seed's fp32 is torch's default, no TF32, which the peer's arguments turned on in this process.
            tf32=False,
        )
    steps, seconds = timed_window(sizes.timed(old), sizes.warmup_steps)
    rate = steps * sizes.old_batch / seconds
    trained = trained_examples(load.data, sizes.steps, sizes.old_batch)
    rates = StepWork(rate, rate * mean_sample_flops(load.shape, trained), rate * mean_sample_tokens(trained))
    memory = (old["peak_memory_bytes"], old["memory_measure"])
    return {
        "label": old_label(sizes.old_batch),
        **figures(load, sizes, {**old, "timeline": timeline.summary}, rates, memory),
        "loss_vocabulary": LOSS_VOCABULARY,
        "full_logits": True,  # T5 as transformers writes it
        "wall_s": round(time.monotonic() - began, 1),
    }


def peer_arm(load: Workload, sizes: QuickSizes, token_budget: int) -> dict:
    """The docs' plain ``Seq2SeqTrainer`` in this process, its batch the defaults' mean questions a step at
    ``token_budget`` (:func:`bench.peer.peer_batch`).

    :rtype: dict
    """
    began = time.monotonic()
    ours = step_samples(load.lengths, token_budget, load.shape, sizes.steps)
    batch = peer_batch(statistics.fmean(step.samples for step in ours))
    timeline = Timeline(sizes.steps + 1, sizes.timeline_steps)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-quick-peer-") as output:
        peer = peer_recipe(
            load.model,
            load.data,
            Path(output),
            StepClock(),
            sizes.trained_steps,
            load.device,
            batch,
            load.shape,
            callbacks=(timeline,),
        )
    per_step = [StepWork(*work) for work in peer["step_work"]]
    rates = throughput(sizes.timed(peer), per_step, sizes.warmup_steps)
    memory = (peer["peak_memory_bytes"], peer["memory_measure"])
    return {
        "label": peer_label(batch, load.device),
        **figures(load, sizes, {**peer, "timeline": timeline.summary}, rates, memory),
        "loss_vocabulary": LOSS_VOCABULARY,
        "full_logits": True,  # T5 as transformers writes it
        "wall_s": round(time.monotonic() - began, 1),
        "batch": batch,
    }


def defaults_arm(
    load: Workload,
    sizes: QuickSizes,
    work: Path,
    chosen: dict,
    name: str = "defaults",
    torch_compile: bool | None = None,
    compile_mode: str | None = None,
) -> dict:
    """The defaults: ``textsql launch`` on one rank, on ``load``'s model. A compiled rank keeps its compile cache in
    ``work``'s :data:`COMPILE_CACHE` (``TORCHINDUCTOR_CACHE_DIR``), empty for the first compiled arm of a run and
    warm for the next.

    :param chosen: :func:`textsql.planning.device_defaults.fast_defaults` of this machine, for the arm's label.
    :param name: the arm's name, which names its run directory.
    :param torch_compile: passed on the command line when given (the compile arm turns the default the other way).
    :param compile_mode: ``--torch-compile-mode`` when given (:data:`CUDA_GRAPHS_MODE`: CUDA graphs).
    :rtype: dict
    """
    began = time.monotonic()
    compiled = chosen.get("torch_compile", False) if torch_compile is None else torch_compile
    run_dir = launch_ours(
        work,
        "gpu-quick-" + name.replace("_", "-"),
        load.model,
        load.data,
        probe_env={
            TIMELINE_VAR: sizes.timeline,
            **({**RECOMPILE_LOGGING, CACHE_VAR: str(work / COMPILE_CACHE)} if compiled else {}),
        },
        max_steps=sizes.trained_steps,
        eval_strategy="no",
        report_to="none",
        max_tokens_per_batch=sizes.token_budget,
        **({} if torch_compile is None else {"torch_compile": torch_compile}),
        **({} if compile_mode is None else {"torch_compile_mode": compile_mode}),
    )
    summary, record = run_summary(run_dir), probe_record(run_dir)
    budget = summary["token_budget"]["max_tokens_per_batch"]
    per_step = step_samples(load.lengths, budget, load.shape, sizes.steps, compiled)
    rates = throughput(sizes.timed(record), per_step, sizes.warmup_steps)
    return {
        "label": (
            f"defaults: textsql launch --ranks 1, model {load.model_label}, profile {summary['profile']} "
            f"({summary['profile_chosen_by']}), {summary['precision']}, {compiled_label(compiled, compile_mode)}, "
            f"{chosen['optim']}, token budget {budget}, --loss_vocabulary {LOSS_VOCABULARY}, --report_to none"
        ),
        **figures(load, sizes, record, rates, peak_memory(record)),
        "loss_vocabulary": summary["loss_vocabulary"],
        "full_logits": summary["full_logits"],
        "wall_s": round(time.monotonic() - began, 1),
        "profile": summary["profile"],
        "precision": summary["precision"],
        "torch_compile": compiled,
        **({"torch_compile_mode": compile_mode} if compile_mode else {}),
        "token_budget": budget,
        **(
            {
                "recompilations": recompilations(run_dir / "bench.log"),
                "compilations_after_warmup": compilations_after(record, sizes.warmup_steps),
                **({"cuda_graphs_skipped": graphs_skipped(run_dir / "bench.log")} if compile_mode else {}),
            }
            if compiled
            else {}
        ),
    }


def compiled_label(compiled: bool, mode: str | None) -> str:
    """How an arm ran the model, for its label: ``eager``, ``torch.compile``, or with its mode.

    :rtype: str
    """
    if not compiled:
        return "eager"
    return "torch.compile" + (f" --torch-compile-mode {mode}" if mode else "")


def graphs_skipped(log: Path) -> dict:
    """How many compiled regions torch ran without CUDA graphs, and why (the first :data:`REASONS_KEPT` reasons),
    from the rank's log under :data:`RECOMPILE_LOGGING`: a region replayed as a graph launches nothing from the host.

    :rtype: dict
    """
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    reasons = [line.split(CUDA_GRAPH_SKIPPED, 1)[1][:REASON_CHARS] for line in lines if CUDA_GRAPH_SKIPPED in line]
    return {"count": len(reasons), "first_reasons": reasons[:REASONS_KEPT]}


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
