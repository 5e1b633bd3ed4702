"""``gpu``: the old notebook's recipe against the project's defaults on one device, in one run.

Measured where CUDA is present (``make bench``), or on the CPU with ``python -m bench gpu --device cpu``
(the same code; only the device, the sizes and the peak differ), which the test suite runs at smoke size.

- Data: WikiSQL-shaped at full scale (:mod:`bench.fullscale`: 56,355 training questions resampled from
  the prepared sample, schema input as the defaults use), the same for both arms.
- Old recipe: every input and query padded to 96, fp32, batch 32, plain AdamW, a plain ``Seq2SeqTrainer``
  in this process; pad positions of the labels are -100, so its loss counts real tokens only, as ours does.
- Ours: ``textsql launch`` on 1 rank with no overrides (the default profile and the defaults of
  :func:`textsql.training.hardware.fast_defaults`), then each profile.
- Both arms: ``warmup_steps + timed_steps + 1`` steps; samples/s from a :class:`bench.steps.StepClock`
  (per-step wall times inside the training process) between the end of step ``warmup_steps`` and the
  end of the last timed step; the extra last step is profiled for op counts (:mod:`bench.steps`).
  Samples a step of ours are rebuilt from its seeded token sampler; MFU on real tokens by
  :mod:`bench.flops`; time to a fixed eval loss is training time from the first step (evaluations
  subtracted, loss-only evaluation in both arms, same eval batch); the loss curve of the defaults against
  the same batches in eager fp32 with plain AdamW; batched against one-at-a-time inference.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import datasets
import torch
from transformers import AutoConfig, Seq2SeqTrainer, Seq2SeqTrainingArguments, default_data_collator

from bench import inference
from bench.events import scalars
from bench.flops import T5Shape, mfu, peak_flops, training_flops
from bench.fullscale import WIKISQL_TRAIN_QUESTIONS, full_scale
from bench.profiles import launch_probed, model_dir
from bench.rank_probe import PROFILE_STEP_VAR, STOP_BELOW_VAR
from bench.steps import StepClock, phase_markers, timed_window, training_seconds_to
from textsql.arguments import train_argv
from textsql.constants import DEFAULT_MODEL_DIR, LABEL_PAD_TOKEN_ID
from textsql.files import read_json
from textsql.model import load_model
from textsql.training.batching import TokenBudgetBatchSampler
from textsql.training.estimate import estimate
from textsql.training.events import TENSORBOARD_SUBDIR
from textsql.training.hardware import DeviceFacts, device_facts, fast_defaults
from textsql.training.profiles import available_profiles

logger = logging.getLogger(__name__)

OLD_BATCH = 32
OLD_MAX_LENGTH = 96
EVAL_BATCH = 32  # both arms evaluate in batches of this size, so their eval losses average alike
SEED = 42  # Seq2SeqTrainingArguments' default seed, which the token sampler is seeded with
GIB = 1024**3
# What the section writes, on any device; tests/test_bench_gpu.py checks them after a smoke run.
SECTION_KEYS = (
    "value",
    "unit",
    "goal",
    "device",
    "versions",
    "data",
    "peak_flops",
    "token_budget",
    "old_recipe_samples_per_s",
    "old_recipe_mfu_real_tokens",
    "profiles",
    "step_ops",
    "seconds_to_eval_loss",
    "loss_curve_vs_eager_fp32",
    "inference",
    "flop_convention",
    "method",
)
ROW_KEYS = (
    "profile",
    "samples_per_s",
    "vs_old_recipe",
    "mfu_real_tokens",
    "max_memory_gib_per_rank",
    "estimate_gpu_gb_per_rank",
    "ops_per_step",
)
# An 80 GB H100 on a 16-core node, as textsql.training.hardware.device_facts describes one.
HOPPER = DeviceFacts(cuda=True, compute_capability=(9, 0), memory_gib=79.1, gpus=1, cpu_cores=16)
OPS_KEYS = ("ops", "host_syncs", "reduce_calls", "optimizer_ops", "optimizer_host_syncs")


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


def available() -> bool:
    """Whether this machine has a CUDA GPU to measure.

    :rtype: bool
    """
    return torch.cuda.is_available()


def pad_to_old_length(batch: dict, pad_id: int) -> dict:
    """The old recipe's inputs: ids cut or padded to 96; label pad positions -100 (never in the loss)."""

    def fixed(rows: list[list[int]], fill: int) -> list[list[int]]:
        return [row[:OLD_MAX_LENGTH] + [fill] * (OLD_MAX_LENGTH - len(row[:OLD_MAX_LENGTH])) for row in rows]

    return {
        "input_ids": fixed(batch["input_ids"], pad_id),
        "attention_mask": fixed(batch["attention_mask"], 0),
        "labels": fixed(batch["labels"], LABEL_PAD_TOKEN_ID),
    }


def old_recipe(
    model: Path,
    data: Path,
    output: Path,
    clock: StepClock,
    max_steps: int,
    device: str,
    batch: int = OLD_BATCH,
    eval_questions: int | None = None,
    **values,
) -> dict:
    """Train the old notebook's way (pad 96, fp32, batch 32, plain AdamW, plain trainer) in this process.

    :param eval_questions: evaluate on the first N validation questions (all when ``None``).
    :param values: more ``Seq2SeqTrainingArguments`` (evaluation settings).
    :returns: the clock's record.
    :rtype: dict
    """
    prepared = datasets.load_from_disk(str(data))
    # The resampled examples are already in random order: the first max_steps batches' worth of them is
    # a fair draw, and padding only those keeps a short run from padding all 56,355.
    prepared["train"] = prepared["train"].select(range(min(len(prepared["train"]), max_steps * batch)))
    if "validation" in prepared and eval_questions is not None:
        prepared["validation"] = prepared["validation"].select(range(min(len(prepared["validation"]), eval_questions)))
    trained = load_model(str(model))
    padded = prepared.map(
        pad_to_old_length, batched=True, fn_kwargs={"pad_id": trained.config.pad_token_id}, desc="pad to 96"
    )
    args = Seq2SeqTrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=EVAL_BATCH,
        max_steps=max_steps,
        optim="adamw_torch",
        learning_rate=1e-3,
        dataloader_drop_last=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=SEED,
        logging_strategy="no",
        use_cpu=device == "cpu",
        **values,
    )
    trained.accepts_loss_kwargs = False
    with phase_markers():
        Seq2SeqTrainer(
            model=trained,
            args=args,
            train_dataset=padded["train"],
            eval_dataset=padded.get("validation"),
            data_collator=default_data_collator,
            callbacks=[clock],
        ).train()
    return clock.record()


def launch_ours(
    work: Path, name: str, model: Path, data: Path, profile_step: int = 0, probe_env: dict | None = None, **values
) -> Path:
    """``textsql train`` with the defaults (changed by ``values``, see :func:`textsql.arguments.train_argv`) on
    1 rank through DeepSpeed's launcher, under :mod:`bench.rank_probe`; the run's directory.

    :rtype: pathlib.Path
    """
    run_dir = work / name
    train_args = train_argv(
        model=str(model),
        data_dir=str(data),
        output_dir=str(run_dir / "out"),
        overwrite_output_dir=True,
        save_strategy="no",
        disable_tqdm=True,
        **values,
    )
    launch_probed(run_dir, 1, train_args, name, env={PROFILE_STEP_VAR: str(profile_step), **(probe_env or {})})
    return run_dir


def step_samples(
    lengths: tuple[list[int], list[int]], budget: int, shape: T5Shape, steps: int
) -> list[tuple[int, float]]:
    """(samples, real-token FLOPs) of each step 1..``steps`` of a 1-rank token-budget run, rebuilt from its seeded sampler.

    :rtype: list[tuple[int, float]]
    """
    sampler = TokenBudgetBatchSampler(*lengths, budget, seed=SEED)
    per_step = []
    for epoch in range(-(-steps // len(sampler))):
        for batch in sampler.epoch_batches(epoch):
            per_step.append((len(batch), sum(training_flops(shape, lengths[0][i], lengths[1][i]) for i in batch)))
    return per_step[:steps]


def throughput(record: dict, per_step: list[tuple[int, float]], skip: int) -> tuple[float, float]:
    """Samples/s and real FLOP/s over the timed window of a clock record (:func:`bench.steps.timed_window`).

    :param per_step: (samples, FLOPs) of every step from the first.
    :rtype: tuple[float, float]
    """
    steps, seconds = timed_window(record, skip)
    done = per_step[skip : skip + steps]
    return sum(n for n, _ in done) / seconds, sum(f for _, f in done) / seconds


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


def device_name(device: str) -> str:
    """The name the peak table is keyed by: CUDA's name of GPU 0, or ``"cpu"``.

    :rtype: str
    """
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


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
    name = device_name(device)
    model = DEFAULT_MODEL_DIR if sizes.tiny_model else model_dir(work)
    data = full_scale(data_dir, work / "fullscale", sizes.questions)
    evaluated = full_scale(data_dir, work / "fullscale-validation", sizes.questions, validation=True)
    shape = T5Shape.from_config(AutoConfig.from_pretrained(model))
    train = datasets.load_from_disk(str(data))["train"]
    lengths = ([len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]])
    mean_flops = statistics.fmean(training_flops(shape, s, t) for s, t in zip(*lengths))
    peak = peak_flops(name, os.cpu_count())
    budget = sizes.token_budget or fast_defaults(device_facts())["max_tokens_per_batch"]
    memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB if device == "cuda" else 80.0
    section: dict = {
        "device": name,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "deepspeed": metadata.version("deepspeed"),
        },
        "data": (
            f"{len(train)} training questions resampled with replacement from the prepared sample's "
            f"{len(datasets.load_from_disk(data_dir)['train'])} (its joint source/target length distribution), "
            "schema input; validation: the sample's"
        ),
        "peak_flops": peak,
        "token_budget": budget,
        "flop_convention": "6 x (N_enc x L_enc + N_dec x L_dec) + attention scores, per sample at its unpadded lengths (bench/flops.py)",
    }

    with tempfile.TemporaryDirectory(prefix="bench-gpu-old-") as output:
        old = old_recipe(
            model, data, Path(output), StepClock(profile_step=sizes.steps), sizes.steps, device, sizes.old_batch
        )
    old_steps, old_seconds = timed_window(old, sizes.warmup_steps)
    old_rate = old_steps * sizes.old_batch / old_seconds
    section |= {
        "old_recipe_samples_per_s": round(old_rate, 2),
        "old_recipe_mfu_real_tokens": _rounded(mfu(old_rate * mean_flops, 1.0, peak)),
        "step_ops": {"old_recipe": old["ops"]},
    }
    save(section)

    per_step = step_samples(lengths, budget, shape, sizes.steps)
    predicted = estimate(str(model), nodes=1, gpus_per_node=1, gpu_memory_gb=memory_gib, cpu=device == "cpu")
    rows = section["profiles"] = {}
    common = {"max_steps": sizes.steps, "eval_strategy": "no", "max_tokens_per_batch": budget}
    for profile in ("default", *(sizes.profiles or available_profiles())):
        # What auto chose was measured as the default: not twice.
        if profile != "default" and profile == rows["default"]["profile"]:
            rows[profile] = rows["default"]
            continue
        chosen = {} if profile == "default" else {"profile": profile}
        run_dir = launch_ours(work, profile, model, data, profile_step=sizes.steps, **common, **chosen)
        record = read_json(run_dir / "probe" / "rank0.json")
        samples, flops = throughput(record, per_step, sizes.warmup_steps)
        used = read_json(run_dir / "out" / "run.json")["profile"]
        memory = record["cuda_max_memory_allocated_bytes"] or record["peak_rss_bytes"]
        rows[profile] = {
            "profile": used,
            "samples_per_s": round(samples, 2),
            "vs_old_recipe": round(samples / old_rate, 2),
            "mfu_real_tokens": _rounded(mfu(flops, 1.0, peak)),
            "max_memory_gib_per_rank": [round(memory / GIB, 3)],
            "estimate_gpu_gb_per_rank": predicted["profiles"][used]["gpu_gb_per_rank"],
            "ops_per_step": record["ops"],
        }
        if profile == "default":
            section["step_ops"]["default"] = {"profile": used, **record["ops"]}
            section |= {"value": rows[profile]["vs_old_recipe"]}
        save(section)

    target, evaluate = sizes.target_eval_loss, {"eval_strategy": "steps", "eval_steps": sizes.eval_steps}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-loss-") as output:
        old_loss = old_recipe(
            model,
            evaluated,
            Path(output),
            StepClock(stop_below=target),
            sizes.loss_steps,
            device,
            sizes.old_batch,
            sizes.eval_questions,
            **evaluate,
        )
    ours_dir = launch_ours(
        work,
        "to-loss",
        model,
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
    ours_loss = read_json(ours_dir / "probe" / "rank0.json")
    section["seconds_to_eval_loss"] = {
        "target": target,
        "old_recipe": _rounded(training_seconds_to(old_loss, target), 1),
        "defaults": _rounded(training_seconds_to(ours_loss, target), 1),
        "defaults_evaluation_share": read_json(ours_dir / "out" / "run.json")["evaluation_share"],
        "how": "training time from the first step to the end of the step whose loss-only evaluation reached the "
        f"target, evaluations subtracted; every {sizes.eval_steps} steps in both arms (ours with --eval_share 0; "
        "its evaluation share is this run's, not the default schedule's), at most {sizes.loss_steps} steps",
    }
    save(section)

    curve = {"max_steps": sizes.curve_steps, "eval_strategy": "no", "logging_steps": 1, "max_tokens_per_batch": budget}
    fast = [
        value
        for *_, value in scalars(launch_ours(work, "curve-defaults", model, data, **curve) / "out" / TENSORBOARD_SUBDIR)
    ]
    eager_dir = launch_ours(
        work, "curve-eager-fp32", model, data, **curve, precision="fp32", optim="adamw_torch", tf32=False
    )
    eager = [value for *_, value in scalars(eager_dir / "out" / TENSORBOARD_SUBDIR)]
    section["loss_curve_vs_eager_fp32"] = curves_match(eager, fast, sizes.curve_tolerance, sizes.curve_window)
    save(section)

    section["inference"] = inference.run(question_data_dir, sizes.infer, device=device)
    section |= {
        "value": rows["default"]["vs_old_recipe"],
        "unit": "x (samples/s defaults / old recipe, same device, same run)",
        "goal": ">= 10.0",
        "method": (
            f"one {name}; model {'the embedded small T5' if sizes.tiny_model else f'of t5-small shape ({shape.d_model} wide, random weights, seed 42)'}; "
            f"{section['data']}; old recipe: plain Seq2SeqTrainer in-process, pad {OLD_MAX_LENGTH}, fp32, batch {sizes.old_batch}, "
            f"adamw_torch; ours: textsql launch --ranks 1 (bench.rank_probe), defaults, token budget {budget}; both arms "
            f"{sizes.steps} steps, samples/s between the ends of step {sizes.warmup_steps} and step "
            f"{sizes.warmup_steps + sizes.timed_steps} (StepClock in the training process), the last step profiled "
            f"for op counts; MFU against the peak {peak} FLOP/s"
        ),
    }
    save(section)
    return section


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class OpsSizes:
    """The op-count figure: a few steps of each arm on the CPU, the last one profiled."""

    steps: int = 3
    tiny_model: bool = False
    token_budget: int = 2048  # op counts do not depend on the batch; a small one keeps CPU steps short


def cuda_default_values(model: Path) -> dict:
    """The ``textsql train`` values a run gets on one 80 GB Hopper GPU (profile ``auto``, precision, optimizer,
    no NaN check), less what a CPU cannot take (TF32, pinned memory, loader workers, the token budget).

    :rtype: dict
    """
    defaults = fast_defaults(HOPPER)
    profile = estimate(str(model), nodes=1, gpus_per_node=1, gpu_memory_gb=HOPPER.memory_gib)["recommended"]
    return {
        "profile": profile,
        "precision": "bf16",
        "optim": defaults["optim"],
        "logging_nan_inf_filter": defaults["logging_nan_inf_filter"],
    }


def run_step_ops(data_dir: str, work: Path, sizes: OpsSizes = OpsSizes()) -> dict:
    """Ops, host syncs and reduce calls per training step and per optimizer step, on the CPU, for the old
    recipe and for what the defaults are on a GPU (:func:`cuda_default_values`).

    :param data_dir: a ``textsql prepare`` output in schema form.
    :rtype: dict
    """
    model = DEFAULT_MODEL_DIR if sizes.tiny_model else model_dir(work)
    data = full_scale(data_dir, work / "fullscale")
    with tempfile.TemporaryDirectory(prefix="bench-ops-old-") as output:
        old = old_recipe(model, data, Path(output), StepClock(profile_step=sizes.steps), sizes.steps, "cpu")
    values = cuda_default_values(model)
    run_dir = launch_ours(
        work,
        "ops-default",
        model,
        data,
        profile_step=sizes.steps,
        max_steps=sizes.steps,
        eval_strategy="no",
        max_tokens_per_batch=sizes.token_budget,
        use_cpu=True,  # transformers refuses bf16 without a GPU unless told the run is on the CPU
        **values,
    )
    tensors = len(list(load_model(str(model)).parameters()))
    return {
        "old_recipe": old["ops"],
        "default": read_json(run_dir / "probe" / "rank0.json")["ops"],
        "default_values": values,
        "model_tensors": tensors,
        "method": (
            f"torch.profiler (CPU) over step {sizes.steps} of {sizes.steps}, one process, model "
            f"{'the embedded small T5' if sizes.tiny_model else 't5-small shape'} ({tensors} tensors); old recipe: plain "
            "Seq2SeqTrainer, fp32, batch 32 padded to 96, adamw_torch; default: textsql launch --ranks 1 with the values a "
            f"run gets on an 80 GB H100 ({values}), token budget {sizes.token_budget}; ops: top-level aten ops; host "
            "syncs: aten::_local_scalar_dense (.item(), float(), bool() of a tensor) and accelerator synchronize calls; "
            "optimizer phase: DeepSpeed's engine.step and the trainer's clipping, grad-norm read, optimizer, scheduler "
            "and zero_grad (bench/steps.py)"
        ),
    }
