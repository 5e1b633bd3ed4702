"""``gpu``: the old notebook's recipe against the project's defaults on one device, in one run.

Measured where CUDA is present (``make bench``), or on the CPU with ``python -m bench gpu --device cpu``
(the same code; only the device, the sizes and the peak differ), which the test suite runs at smoke size.

- Data: WikiSQL-shaped at full scale (:mod:`bench.fullscale`: 56,355 training questions resampled from
  the prepared sample, schema input as the defaults use), the same for both arms.
- Old recipe (:mod:`bench.old_recipe`): every input and query padded to 96, fp32, eager, batch 32, plain AdamW,
  a plain ``Seq2SeqTrainer`` in this process.
- Ours (:mod:`bench.ours`): ``textsql launch`` on 1 rank with no overrides but the loss (the default profile and
  the defaults of :func:`textsql.planning.device_defaults.fast_defaults`), then each profile.
- Both arms train the full-vocabulary loss, a pretrained T5 user's (``loss_vocabulary`` recorded per arm).
- Both arms: ``warmup_steps + timed_steps + 1`` steps; samples/s from a :class:`bench.steps.StepClock`
  (per-step wall times inside the training process) between the end of step ``warmup_steps`` and the
  end of the last timed step; the extra last step is profiled for op counts (:mod:`bench.steps`).
  Samples a step of ours are rebuilt from its seeded token sampler; MFU on real tokens by
  :mod:`bench.flops`; time to a fixed eval loss is training time from the first step (evaluations
  subtracted, loss-only evaluation in both arms, same eval batch); the loss curve of the defaults against
    the same batches eager (``--torch_compile false``) in fp32 with plain AdamW; batched against one-at-a-time
  inference.

An estimated 25-45 minutes on one H100. Where the GPU machine is yours for minutes, not an hour,
``python -m bench gpu-quick`` (:mod:`bench.gpu_quick`) compares the same two recipes in a few.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import inference
from bench.events import scalars
from bench.flops import FLOP_CONVENTION, mfu
from bench.fullscale import WIKISQL_TRAIN_QUESTIONS, full_scale
from bench.old_recipe import (
    EVAL_BATCH,
    LOSS_VOCABULARY,
    OLD_BATCH,
    mean_sample_flops,
    old_recipe,
    trained_examples,
)
from bench.old_recipe import label as old_label
from bench.ours import launch_ours, peak_memory, probe_record, run_summary, step_samples, throughput
from bench.rank_probe import STOP_BELOW_VAR
from bench.steps import StepClock, timed_window, training_seconds_to
from bench.timing import rounded
from bench.workload import Workload, versions
from textsql.planning.device_defaults import device_facts, fast_defaults
from textsql.planning.estimate import estimate
from textsql.planning.profiles import available_profiles
from textsql.training.events import TENSORBOARD_SUBDIR

logger = logging.getLogger(__name__)

GIB = 1024**3
# The curve's reference arm: what the defaults turn on, turned off.
EAGER_FP32 = {"precision": "fp32", "optim": "adamw_torch", "tf32": False, "torch_compile": False}


@dataclass(frozen=True)
class Sizes:
    """How much work the GPU section does."""

    warmup_steps: int = 20  # left out of samples/s in both arms (allocator, cuDNN/cuBLAS heuristics)
    timed_steps: int = 200
    questions: int = WIKISQL_TRAIN_QUESTIONS
    tiny_model: bool = False  # the embedded small T5 instead of t5-small's shape
    old_batch: int = OLD_BATCH  # the old recipe's batch (smaller only in the smoke run)
    # Validation questions each evaluation of the time-to-loss runs scores: whole batches of EVAL_BATCH, since
    # the old recipe's dataloader_drop_last drops a partial evaluation batch too.
    eval_questions: int = 96
    token_budget: int | None = None  # None: the defaults' budget for the device (fast_defaults)
    profiles: tuple[str, ...] = ()  # empty: every profile in dsconfig/
    target_eval_loss: float = 1.0
    loss_steps: int = 5000  # the most steps either arm trains to reach the target
    eval_steps: int = 100
    curve_steps: int = 300
    curve_tolerance: float = 0.05  # mean relative gap of the smoothed loss curves
    curve_window: int = 10  # steps each loss curve is smoothed over before comparing
    infer: inference.Sizes = field(default_factory=lambda: inference.Sizes(questions=256, max_new_tokens=32))

    def __post_init__(self) -> None:
        if self.warmup_steps < 1 or self.timed_steps < 1:
            raise ValueError(f"warmup_steps and timed_steps must be >= 1, got {self.warmup_steps}, {self.timed_steps}")
        if self.eval_questions % EVAL_BATCH:
            raise ValueError(f"eval_questions must be a multiple of {EVAL_BATCH}, got {self.eval_questions}")

    @property
    def steps(self) -> int:
        """Steps of a throughput run: warm-up, timed, and one profiled step."""
        return self.warmup_steps + self.timed_steps + 1


def curves_match(reference: list[float], candidate: list[float], tolerance: float, window: int = 10) -> dict:
    """Compare two loss curves step by step after smoothing each over ``window`` steps.

    :returns: the mean and largest relative gap, and whether the mean is within ``tolerance``.
    :rtype: dict
    """
    steps = min(len(reference), len(candidate))
    if steps < window:
        raise ValueError(f"{steps} common steps; need at least {window}")

    def smooth(values: list[float]) -> list[float]:
        return [statistics.fmean(values[i : i + window]) for i in range(steps - window + 1)]

    gaps = [abs(c - r) / abs(r) for r, c in zip(smooth(reference[:steps]), smooth(candidate[:steps]))]
    mean = statistics.fmean(gaps)
    return {
        "mean_relative_gap": round(mean, 4),
        "max_relative_gap": round(max(gaps), 4),
        "tolerance": tolerance,
        "within": mean <= tolerance,
    }


def run(
    data_dir: str,
    question_data_dir: str,
    work: Path,
    sizes: Sizes = Sizes(),
    device: str = "cuda",
    save: Callable[[dict], None] = lambda section: None,
) -> dict:
    """Every figure of the section; ``save`` gets the section so far after each part finishes.

    :param data_dir: a ``textsql prepare`` output in the defaults' (schema) input form.
    :param question_data_dir: one in question-only form (the inference part's data).
    :param work: scratch directory.
    :param device: ``cuda`` (call only where :func:`available`) or ``cpu``.
    :rtype: dict
    """
    load = Workload.build(data_dir, work, device, sizes.tiny_model, sizes.questions)
    evaluated = full_scale(data_dir, work / "fullscale-validation", sizes.questions, validation=True)
    budget = sizes.token_budget or fast_defaults(device_facts())["max_tokens_per_batch"]
    memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB if device == "cuda" else 80.0
    section: dict = {
        "device": load.device_name,
        "versions": versions(),
        "data": f"{load.describe_data()}; validation: the sample's",
        "peak_flops": load.peak,
        "token_budget": budget,
        "flop_convention": FLOP_CONVENTION,
        "loss_vocabulary": {"old_recipe": LOSS_VOCABULARY},
    }
    old_rate, old = old_recipe_throughput(load, sizes)
    section |= old
    save(section)
    section["profiles"] = {}
    for profile, row in profile_rows(load, sizes, work, budget, memory_gib, old_rate):
        section["profiles"][profile] = row
        if profile == "default":
            section["step_ops"]["default"] = {"profile": row["profile"], **row["ops_per_step"]}
            section |= {"value": row["vs_old_recipe"]}
            section["loss_vocabulary"]["defaults"] = row["loss_vocabulary"]
        save(section)
    section["seconds_to_eval_loss"] = seconds_to_eval_loss(load, evaluated, sizes, work, budget)
    save(section)
    section["loss_curve_vs_eager_fp32"] = loss_curve_vs_eager(load, sizes, work, budget)
    save(section)
    section["inference"] = inference.run(question_data_dir, sizes.infer, device=device)
    section |= {
        "value": section["profiles"]["default"]["vs_old_recipe"],
        "unit": "x (samples/s defaults / old recipe, same device, same run)",
        "goal": ">= 10.0",
        "method": (
            f"one {load.device_name}; model {load.model_label}; {section['data']}; {old_label(sizes.old_batch)}; ours: "
            f"textsql launch --ranks 1 (bench.rank_probe), defaults but --loss_vocabulary {LOSS_VOCABULARY}, token "
            f"budget {budget}; both arms {sizes.steps} steps, samples/s between the ends of step {sizes.warmup_steps} "
            f"and step {sizes.warmup_steps + sizes.timed_steps} (StepClock in the training process), the last step "
            f"profiled for op counts; MFU against the peak {load.peak} FLOP/s"
        ),
    }
    save(section)
    return section


def old_recipe_throughput(load: Workload, sizes: Sizes) -> tuple[float, dict]:
    """The old recipe's throughput run in this process, its last step profiled.

    :returns: its samples/s, and the section's entries for it (samples/s, MFU, op counts).
    :rtype: tuple[float, dict]
    """
    with tempfile.TemporaryDirectory(prefix="bench-gpu-old-") as output:
        old = old_recipe(
            load.model,
            load.data,
            Path(output),
            StepClock(profile_step=sizes.steps),
            sizes.steps,
            load.device,
            sizes.old_batch,
        )
    old_steps, old_seconds = timed_window(old, sizes.warmup_steps)
    old_rate = old_steps * sizes.old_batch / old_seconds
    old_flops = mean_sample_flops(load.shape, trained_examples(load.data, sizes.steps, sizes.old_batch))
    return old_rate, {
        "old_recipe_samples_per_s": round(old_rate, 2),
        "old_recipe_mfu_real_tokens": rounded(mfu(old_rate * old_flops, 1.0, load.peak)),
        "step_ops": {"old_recipe": old["ops"]},
    }


def profile_rows(
    load: Workload, sizes: Sizes, work: Path, budget: int, memory_gib: float, old_rate: float
) -> Iterator[tuple[str, dict]]:
    """One launch of ours per profile, the defaults first: each profile's row as it is measured.

    :param memory_gib: the device's memory, for the estimate beside each row.
    :param old_rate: the old recipe's samples/s, each row's reference.
    :rtype: Iterator[tuple[str, dict]]
    """
    per_step = step_samples(load.lengths, budget, load.shape, sizes.steps)
    predicted = estimate(str(load.model), nodes=1, gpus_per_node=1, gpu_memory_gb=memory_gib, cpu=load.device == "cpu")
    common = {"max_steps": sizes.steps, "eval_strategy": "no", "max_tokens_per_batch": budget}
    default: dict = {}
    for profile in ("default", *(sizes.profiles or available_profiles())):
        # What auto chose was measured as the default: not twice.
        if profile != "default" and profile == default["profile"]:
            yield profile, default
            continue
        chosen = {} if profile == "default" else {"profile": profile}
        run_dir = launch_ours(work, profile, load.model, load.data, profile_step=sizes.steps, **common, **chosen)
        record = probe_record(run_dir)
        samples, flops, tokens = throughput(record, per_step, sizes.warmup_steps)
        summary = run_summary(run_dir)
        used = summary["profile"]
        memory, _ = peak_memory(record)
        row = {
            "profile": used,
            "samples_per_s": round(samples, 2),
            "real_tokens_per_s": round(tokens),
            "vs_old_recipe": round(samples / old_rate, 2),
            "mfu_real_tokens": rounded(mfu(flops, 1.0, load.peak)),
            "max_memory_gib_per_rank": [round(memory / GIB, 3)],
            "estimate_gpu_gb_per_rank": predicted["profiles"][used]["gpu_gb_per_rank"],
            "ops_per_step": record["ops"],
            "loss_vocabulary": summary["loss_vocabulary"],
        }
        if profile == "default":
            default = row
        yield profile, row


def seconds_to_eval_loss(load: Workload, evaluated: Path, sizes: Sizes, work: Path, budget: int) -> dict:
    """Training time of each arm to the target evaluation loss, loss-only evaluations at the same steps in both.

    :param evaluated: the full-scale data with the sample's validation split.
    :rtype: dict
    """
    target, evaluate = sizes.target_eval_loss, {"eval_strategy": "steps", "eval_steps": sizes.eval_steps}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-loss-") as output:
        old_loss = old_recipe(
            load.model,
            evaluated,
            Path(output),
            StepClock(stop_below=target),
            sizes.loss_steps,
            load.device,
            sizes.old_batch,
            sizes.eval_questions,
            **evaluate,
        )
    ours_dir = launch_ours(
        work,
        "to-loss",
        load.model,
        evaluated,
        max_steps=sizes.loss_steps,
        max_tokens_per_batch=budget,
        predict_with_generate=False,
        max_eval_samples=sizes.eval_questions,
        per_device_eval_batch_size=EVAL_BATCH,
        probe_env={STOP_BELOW_VAR: str(target)},
        eval_share=0,  # every eval_steps, as the old recipe: both arms check the target at the same steps
        **evaluate,
    )
    ours_loss = probe_record(ours_dir)
    return {
        "target": target,
        "old_recipe": rounded(training_seconds_to(old_loss, target), 1),
        "defaults": rounded(training_seconds_to(ours_loss, target), 1),
        "defaults_evaluation_share": run_summary(ours_dir)["evaluation_share"],
        "how": "training time from the first step to the end of the step whose loss-only evaluation reached the "
        f"target, evaluations subtracted; every {sizes.eval_steps} steps in both arms (ours with --eval_share 0; "
        f"its evaluation share is this run's, not the default schedule's), at most {sizes.loss_steps} steps",
    }


def loss_curve_vs_eager(load: Workload, sizes: Sizes, work: Path, budget: int) -> dict:
    """The defaults' loss curve against the same launch eager in fp32 with plain AdamW, over the same batches.

    :rtype: dict
    """
    curve = {"max_steps": sizes.curve_steps, "eval_strategy": "no", "logging_steps": 1, "max_tokens_per_batch": budget}
    fast_dir = launch_ours(work, "curve-defaults", load.model, load.data, **curve)
    fast = [value for *_, value in scalars(fast_dir / "out" / TENSORBOARD_SUBDIR)]
    eager_dir = launch_ours(work, "curve-eager-fp32", load.model, load.data, **curve, **EAGER_FP32)
    eager = [value for *_, value in scalars(eager_dir / "out" / TENSORBOARD_SUBDIR)]
    return {
        **curves_match(eager, fast, sizes.curve_tolerance, sizes.curve_window),
        "reference": f"the same launch with {EAGER_FP32}: eager, fp32, plain AdamW, {LOSS_VOCABULARY}-vocabulary loss",
        "candidate": f"the defaults on this device, {LOSS_VOCABULARY}-vocabulary loss",
    }
