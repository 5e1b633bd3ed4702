"""The training step a GPU with bf16 gets, run on the CPU: profile zero0 under DeepSpeed's bf16 autocast, torch's
fused AdamW, T5 with every change of textsql/model/speedups.py and the bf16 weight copies
(textsql/model/weight_copies.py), token-budget batches from loader workers. It must learn step for step as fp32
does on the same batches.

tests/test_model.py holds each change to T5's bits with an optimizer of its own; this holds the step as
``textsql train`` puts it together (the trainer, DeepSpeed's engine, the optimizer a GPU run gets). The weight copies
once computed a whole bf16 run from its first step's weights: fused AdamW changes the weights without counting a
change in their version, and the model-level tests stepped another AdamW.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiny_run import tiny_run_argv

pytestmark = pytest.mark.slow

TEXTSQL = Path(sys.executable).with_name("textsql")
STEPS = 8
# bf16's rounding in the forward moves a step's loss by under 1 % of fp32's over these steps; copies of the first
# step's weights left it above twice fp32's by step 8.
RELATIVE_TOLERANCE = 0.05


def step_losses(prepared: Path, output: Path, *precision: str) -> tuple[dict, list[float]]:
    command = [
        str(TEXTSQL),
        "train",
        *tiny_run_argv(
            prepared,
            output,
            max_steps=STEPS,
            eval_every=None,
            profile="zero0",
            optim="adamw_torch_fused",
            logging_nan_inf_filter=False,
            # A GPU's data path: token-budget batches from length buckets, loader workers kept between epochs.
            max_tokens_per_batch=512,
            dataloader_num_workers=2,
            dataloader_persistent_workers=True,
            learning_rate=3e-3,
            save_strategy="no",
            max_eval_samples=4,
            generation_max_length=8,
        ),
        *precision,
    ]
    result = subprocess.run(
        command, check=False, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    summary = json.loads((output / "run.json").read_text())
    return summary, [entry["loss"] for entry in summary["log_history"] if "loss" in entry]


def test_the_gpus_bf16_step_learns_on_the_cpu_step_for_step_as_fp32(prepared_sample, tmp_path):
    fp32_summary, fp32 = step_losses(prepared_sample, tmp_path / "fp32", "--precision", "fp32")
    # transformers refuses bf16 without a GPU unless told the run is on the CPU.
    bf16_summary, bf16 = step_losses(prepared_sample, tmp_path / "bf16", "--precision", "bf16", "--use-cpu", "true")
    assert (fp32_summary["precision"], bf16_summary["precision"]) == ("fp32", "bf16")
    for summary in (fp32_summary, bf16_summary):
        assert (summary["profile"], summary["token_budget"]["max_tokens_per_batch"]) == ("zero0", 512)
    assert len(fp32) == len(bf16) == STEPS
    assert bf16 != fp32, "the bf16 run computed fp32's bits: it did not run under bf16 autocast"
    assert fp32[-1] < fp32[0] / 2, f"fp32 did not learn, so nothing is compared: {fp32}"
    for step, (loss, expected) in enumerate(zip(bf16, fp32, strict=True), start=1):
        assert abs(loss - expected) <= RELATIVE_TOLERANCE * expected, f"step {step}: bf16 {bf16}, fp32 {fp32}"
