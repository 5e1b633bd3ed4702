"""``ops``: ops, host syncs and reduce calls of one training step of each arm, counted on the CPU.

The old recipe (:mod:`bench.old_recipe`) against what the defaults are on one 80 GB H100
(:func:`cuda_default_values`), both training the full-vocabulary loss, the last of a few steps profiled
(:mod:`bench.steps`).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.fullscale import full_scale
from bench.old_recipe import LOSS_VOCABULARY, old_recipe
from bench.ours import launch_ours, probe_record
from bench.profiles import model_dir
from bench.steps import StepClock
from textsql.constants import DEFAULT_MODEL_DIR
from textsql.model import load_model
from textsql.planning.device_defaults import DeviceFacts, fast_defaults
from textsql.planning.estimate import estimate

logger = logging.getLogger(__name__)

# An 80 GB H100 on a 16-core node, as textsql.planning.device_defaults.device_facts describes one.
HOPPER = DeviceFacts(cuda=True, compute_capability=(9, 0), memory_gib=79.1, gpus=1, cpu_cores=16)


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
        "default": probe_record(run_dir)["ops"],
        "default_values": {**values, "loss_vocabulary": LOSS_VOCABULARY},
        "model_tensors": tensors,
        "method": (
            f"torch.profiler (CPU) over step {sizes.steps} of {sizes.steps}, one process, model "
            f"{'the embedded small T5' if sizes.tiny_model else 't5-small shape'} ({tensors} tensors); old recipe: plain "
            "Seq2SeqTrainer, fp32, batch 32 padded to 96, adamw_torch; default: textsql launch --ranks 1 with the values a "
            f"run gets on an 80 GB H100 ({values}), token budget {sizes.token_budget}; both arms the "
            f"{LOSS_VOCABULARY}-vocabulary loss (a pretrained T5's); ops: top-level aten ops; compute ops: aten ops without "
            "aten children that are neither views nor allocations, a multi-tensor op once (about a GPU kernel each); host "
            "syncs: aten::_local_scalar_dense (.item(), float(), bool() of a tensor) and accelerator synchronize calls; "
            "optimizer phase: DeepSpeed's engine.step and the trainer's clipping, grad-norm read, optimizer, scheduler "
            "and zero_grad (bench/steps.py)"
        ),
    }
