"""``gpu``: the old notebook's recipe against the project's defaults on one CUDA GPU, in one run.

Measured only where CUDA is present; elsewhere :func:`available` is false and ``python -m bench``
leaves this section out (the CPU figures stay as they are).

- Old recipe: every input and query padded to 96, fp32, batch 32, plain AdamW, a plain ``Seq2SeqTrainer``
  in this process (:func:`bench.train_padding.seed_padding`).
- Ours: ``textsql launch`` on 1 rank with no overrides (the default profile and the defaults of
  :func:`textsql.training.hardware.fast_defaults`: bf16, fused AdamW, TF32, token-budget batches), then each profile.
- Samples/s between two logged steps after warm-up (samples per step rebuilt from the seeded token
  sampler); ``torch.cuda.max_memory_allocated`` per rank beside ``textsql estimate``; MFU on real tokens
  by :mod:`bench.flops` (the encoder-decoder convention, attention scores included); time from start to
  a fixed eval loss for both; the loss curve of the defaults against the same batches in eager fp32 with
  plain AdamW; batched against one-at-a-time inference (:mod:`bench.inference` on the GPU).
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path

import datasets
import torch
from transformers import AutoConfig, Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback, default_data_collator

from bench import inference
from bench.events import scalars
from bench.flops import T5Shape, mfu, peak_flops, training_flops
from bench.profiles import launch_probed, model_dir, train_only
from bench.train_padding import StepClock, seed_padding
from textsql.arguments import train_argv
from textsql.files import read_json
from textsql.model import load_model, load_tokenizer
from textsql.training.batching import TokenBudgetBatchSampler
from textsql.training.estimate import estimate
from textsql.training.events import TENSORBOARD_SUBDIR
from textsql.training.hardware import device_facts, fast_defaults
from textsql.training.profiles import available_profiles

logger = logging.getLogger(__name__)

OLD_BATCH = 32
SEED = 42  # Seq2SeqTrainingArguments' default seed, which the token sampler is seeded with
GIB = 1024**3


@dataclass(frozen=True)
class Sizes:
    """How much work the GPU section does."""

    epochs: int = 3
    skip_steps: int = 20  # warm-up steps left out of samples/s (allocator, cuDNN/cuBLAS heuristics)
    profiles: tuple[str, ...] = ()  # empty: every profile in dsconfig/
    target_eval_loss: float = 1.0
    loss_epochs: int = 20
    eval_steps: int = 50
    curve_steps: int = 300
    curve_tolerance: float = 0.05  # mean relative gap of the smoothed loss curves
    infer: inference.Sizes = field(default_factory=lambda: inference.Sizes(questions=256, max_new_tokens=32))


def available() -> bool:
    """Whether this machine has a CUDA GPU to measure.

    :rtype: bool
    """
    return torch.cuda.is_available()


class EvalLossClock(TrainerCallback):
    """Seconds from ``started`` to the first evaluation at or below ``target``; stops training there."""

    def __init__(self, started: float, target: float) -> None:
        self.started, self.target, self.seconds = started, target, None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.seconds is None and metrics and metrics.get("eval_loss", float("inf")) <= self.target:
            self.seconds = time.perf_counter() - self.started
            control.should_training_stop = True


def old_recipe(
    model: Path,
    prepared: datasets.DatasetDict,
    output: Path,
    epochs: int,
    callback: TrainerCallback,
    evaluate: int | None = None,
) -> None:
    """Train the old notebook's way: pad to 96, fp32, batch 32, plain AdamW, plain trainer."""
    tokenizer = load_tokenizer(str(model))
    padded = prepared.map(
        partial(seed_padding, tokenizer=tokenizer), batched=True, remove_columns=prepared["train"].column_names
    )
    args = Seq2SeqTrainingArguments(
        output_dir=str(output),
        per_device_train_batch_size=OLD_BATCH,
        num_train_epochs=epochs,
        optim="adamw_torch",
        learning_rate=1e-3,
        dataloader_drop_last=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=SEED,
        logging_strategy="no",
        eval_strategy="steps" if evaluate else "no",
        eval_steps=evaluate,
        per_device_eval_batch_size=OLD_BATCH,
    )
    trained = load_model(str(model))
    trained.accepts_loss_kwargs = False
    Seq2SeqTrainer(
        model=trained,
        args=args,
        train_dataset=padded["train"],
        eval_dataset=padded.get("validation"),
        data_collator=default_data_collator,
        callbacks=[callback],
    ).train()


def launch_ours(work: Path, name: str, model: Path, data: Path, **values) -> Path:
    """``textsql train`` with the defaults (changed by ``values``, see :func:`textsql.arguments.train_argv`) on
    1 rank through DeepSpeed's launcher; the run's output directory.

    :rtype: pathlib.Path
    """
    run_dir, output = work / name, work / name / "out"
    train_args = train_argv(
        model=str(model),
        data_dir=str(data),
        output_dir=str(output),
        overwrite_output_dir=True,
        save_strategy="no",
        disable_tqdm=True,
        **values,
    )
    launch_probed(run_dir, 1, train_args, name)
    return output


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


def throughput(output: Path, per_step: list[tuple[int, float]], skip: int) -> tuple[float, float]:
    """Samples/s and real FLOP/s between the first logged step after ``skip`` and the last.

    :rtype: tuple[float, float]
    """
    times = [(step, wall) for step, wall, _ in scalars(output / TENSORBOARD_SUBDIR)]
    (first, start), (last, end) = next(t for t in times if t[0] >= skip), times[-1]
    done = per_step[first:last]
    return sum(n for n, _ in done) / (end - start), sum(f for _, f in done) / (end - start)


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


def run(data_dir: str, work: Path, sizes: Sizes = Sizes()) -> dict:
    """Every GPU figure; call only where :func:`available`.

    :param data_dir: a ``textsql prepare`` output (train and validation).
    :param work: scratch directory.
    :rtype: dict
    """
    device = torch.cuda.get_device_name(0)
    model, data = model_dir(work), train_only(data_dir, work)
    shape = T5Shape.from_config(AutoConfig.from_pretrained(model))
    prepared = datasets.load_from_disk(data_dir)
    train = prepared["train"]
    lengths = ([len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]])
    mean_flops = statistics.fmean(training_flops(shape, s, t) for s, t in zip(*lengths))
    peak = peak_flops(device)
    budget = fast_defaults(device_facts())["max_tokens_per_batch"]

    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-old-") as output:
        old_recipe(model, prepared, Path(output), sizes.epochs, clock)
    old_steps = sizes.epochs * (len(train) // OLD_BATCH)
    old_rate = old_steps * OLD_BATCH / (clock.ended[0] - clock.started[0])

    steps = sizes.epochs * len(TokenBudgetBatchSampler(*lengths, budget, seed=SEED))
    per_step = step_samples(lengths, budget, shape, steps)
    common = {"num_train_epochs": sizes.epochs, "eval_strategy": "no", "logging_steps": sizes.skip_steps}
    rows, predicted = (
        {},
        estimate(
            str(model), nodes=1, gpus_per_node=1, gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / GIB
        ),
    )
    for name in ("default", *(sizes.profiles or available_profiles())):
        output = launch_ours(work, name, model, data, **common, **({} if name == "default" else {"profile": name}))
        samples, flops = throughput(output, per_step, sizes.skip_steps)
        probe = read_json(output.parent / "probe" / "rank0.json")
        rows[name] = {
            "samples_per_s": round(samples, 1),
            "vs_old_recipe": round(samples / old_rate, 2),
            "mfu_real_tokens": round(mfu(flops, 1.0, peak), 4) if peak else None,
            "cuda_max_memory_allocated_gib_per_rank": [round(probe["cuda_max_memory_allocated_bytes"] / GIB, 3)],
            "estimate_gpu_gb_per_rank": predicted["profiles"].get(name, {}).get("gpu_gb_per_rank"),
        }

    started = time.perf_counter()
    loss_clock = EvalLossClock(started, sizes.target_eval_loss)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-loss-") as output:
        old_recipe(model, prepared, Path(output), sizes.loss_epochs, loss_clock, evaluate=sizes.eval_steps)
    started_ours = time.time()
    output = launch_ours(
        work, "to-loss", model, Path(data_dir), num_train_epochs=sizes.loss_epochs, eval_steps=sizes.eval_steps
    )
    reached = [
        wall for _, wall, value in scalars(output / TENSORBOARD_SUBDIR, "eval/loss") if value <= sizes.target_eval_loss
    ]

    curve = {"max_steps": sizes.curve_steps, "eval_strategy": "no", "logging_steps": 1}
    fast = [
        value for *_, value in scalars(launch_ours(work, "curve-defaults", model, data, **curve) / TENSORBOARD_SUBDIR)
    ]
    eager = [
        value
        for *_, value in scalars(
            launch_ours(
                work, "curve-eager-fp32", model, data, **curve, precision="fp32", optim="adamw_torch", tf32=False
            )
            / TENSORBOARD_SUBDIR
        )
    ]

    default = rows["default"]
    return {
        "value": default["vs_old_recipe"],
        "unit": "x (samples/s defaults / old recipe, same GPU, same run)",
        "goal": ">= 10.0",
        "device": device,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "deepspeed": metadata.version("deepspeed"),
        },
        "old_recipe_samples_per_s": round(old_rate, 1),
        "old_recipe_mfu_real_tokens": round(mfu(old_rate * mean_flops, 1.0, peak), 4) if peak else None,
        "token_budget": budget,
        "profiles": rows,
        "seconds_to_eval_loss": {
            "target": sizes.target_eval_loss,
            "old_recipe": loss_clock.seconds and round(loss_clock.seconds, 1),
            "defaults": round(reached[0] - started_ours, 1) if reached else None,
        },
        "loss_curve_vs_eager_fp32": curves_match(eager, fast, sizes.curve_tolerance),
        "inference": inference.run(data_dir, sizes.infer, device="cuda"),
        "flop_convention": "6 x (N_enc x L_enc + N_dec x L_dec) + attention scores, per sample at its unpadded lengths (bench/flops.py)",
        "method": (
            f"one {device}; model of t5-small's shape ({shape.d_model} wide, random weights, seed 42) on the prepared sample; "
            f"old recipe: plain Seq2SeqTrainer in-process, pad 96, fp32, batch {OLD_BATCH}, adamw_torch, {sizes.epochs} epochs timed "
            f"first step to last; ours: textsql launch --ranks 1 (bench.rank_probe), defaults, token budget {budget}, "
            f"{sizes.epochs} epochs, samples/s between logged steps {sizes.skip_steps} and the last; MFU against the dense bf16 "
            f"peak {peak}; time to eval loss {sizes.target_eval_loss} from the arm's start (start-up and evaluation included)"
        ),
    }
