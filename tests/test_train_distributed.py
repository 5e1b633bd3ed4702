"""Real training runs: two CPU ranks started by DeepSpeed's own launcher, one run per profile.

Each run is as small as it can be while still real (a 48-question slice of the shipped WikiSQL
sample, 8 steps, 2 ranks of one thread). zero3_offload builds DeepSpeed's CPU Adam once into
the extensions cache (about a minute; `make test` keeps one per checkout) and reuses it afterwards,
so the environment's TORCH_EXTENSIONS_DIR is passed through untouched.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tiny_run import tiny_run_argv
from textsql.display.tensorboard import read_scalars
from textsql.planning.profiles import available_profiles, get_profile
from textsql.training.shared_buffer import BUFFER_PREFIX, SHARED_MEMORY_DIR
from worker.network import free_port

pytestmark = pytest.mark.slow

DEEPSPEED = Path(sys.executable).with_name("deepspeed")
RANKS = 2
STEPS = 8
RUN_TIMEOUT_S = 600
REFUSAL_S = 240  # a second run refused before training: with a first run, under the suite's 900 s per test
AUTO_ON_TWO_CPU_RANKS = "zero1"


@pytest.fixture(scope="module")
def prepared_data(tmp_path_factory) -> Path:
    from textsql.data.prepare import PrepareArguments, prepare

    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(PrepareArguments(data_dir=str(out), limit=48, max_source_length=96))
    return out


def launch(data: Path, output: Path, profile: str, *flags: str, master_port: int = 0) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus 2 --module textsql.training.train ...` on this machine, no ssh (the CPU
    accelerator counts one device; --num_gpus sets the ranks per host)."""
    command = [
        str(DEEPSPEED),
        "--num_gpus",
        str(RANKS),
        "--master_port",
        str(master_port or free_port()),
        "--module",
        "textsql.training.train",
        *tiny_run_argv(
            data,
            output,
            max_steps=STEPS,
            eval_every=4,
            profile=profile,
            learning_rate=3e-3,
            save_steps=STEPS,
            per_device_eval_batch_size=4,
        ),
        *flags,
    ]
    environment = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        command, check=False, env=environment, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    (output.parent / f"{profile}.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result


# Every profile trains once: zero1 through `auto`, which resolves to it on two CPU ranks (one launch, both checked).
PROFILES = ["auto" if name == AUTO_ON_TWO_CPU_RANKS else name for name in available_profiles()]


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_trains_on_two_ranks_and_exports_a_plain_model(profile, prepared_data, tmp_path):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    output = tmp_path / "run"
    output.mkdir()
    (output / "notes.txt").write_text("not the trainer's")
    master_port = free_port()
    result = launch(prepared_data, output, profile, master_port=master_port)
    # Both ranks on one machine: DeepSpeed's CPU op gave each an all-reduce buffer in /dev/shm, which it never
    # removes; the ranks removed the names once mapped, so the run's memory went with its processes.
    assert "deepspeed_shm_comm_op built successfully" in result.stdout
    assert sorted(SHARED_MEMORY_DIR.glob(f"{BUFFER_PREFIX}_*_{master_port}_*")) == []

    summary = json.loads((output / "run.json").read_text())
    # auto: the small T5 fits unsharded in each CPU rank's share of host memory, so the cheapest stage.
    used = AUTO_ON_TWO_CPU_RANKS if profile == "auto" else profile
    assert (summary["profile"], summary["profile_chosen_by"]) == (used, "auto" if profile == "auto" else "name")
    assert f"profile {used} (ZeRO-{get_profile(used).stage}" in result.stdout, (
        "the stage line names the profile the run uses"
    )
    assert summary["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert summary["world_size"] == RANKS
    assert summary["zero_stage"] == get_profile(used).stage
    assert summary["global_step"] == STEPS
    # ZeRO-3 partitions the output layer's weight: the loss falls back to the full vocabulary there.
    assert summary["loss_vocabulary"] == ("full" if get_profile(used).stage == 3 else "batch")
    assert summary["full_logits"] == (get_profile(used).stage == 3)
    losses = [entry["loss"] for entry in summary["log_history"] if "loss" in entry]
    assert len(losses) == STEPS
    assert all(math.isfinite(loss) for loss in losses), losses
    assert sum(losses[-2:]) < sum(losses[:2]), f"the loss did not fall: {losses}"
    assert (output / "notes.txt").read_text() == "not the trainer's"

    scalars = read_scalars(output / "tensorboard")
    tags = {tag for run in scalars.values() for tag in run}
    assert {"train/loss", "train/learning_rate", "eval/loss", "eval/exact_match"} <= tags

    model_dir = output / "model"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "prepare.json"):
        assert (model_dir / name).is_file(), name
    model = T5ForConditionalGeneration.from_pretrained(model_dir)
    AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in (output / "eval_predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    if used != "zero0":  # stage 0 writes no ZeRO shards
        # The consolidated export holds exactly the weights of the engine's sharded checkpoint at the
        # same step: compared as data, not through generations whose arithmetic differs by process.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sharded = get_fp32_state_dict_from_zero_checkpoint(str(output / f"checkpoint-{STEPS}"))
        exported = model.state_dict()
        assert set(sharded) <= set(exported) and len(sharded) > 0
        different = [name for name, tensor in sharded.items() if not torch.equal(tensor, exported[name])]
        assert different == []


def test_textsql_train_alone_is_one_rank_on_a_deepspeed_engine(prepared_data, tmp_path):
    textsql = Path(sys.executable).with_name("textsql")
    command = [
        str(textsql),
        "train",
        *tiny_run_argv(
            prepared_data,
            tmp_path,
            max_steps=2,
            eval_every=None,
            profile="zero1",
            save_steps=2,
            max_eval_samples=4,
            generation_max_length=8,
            logging_steps=None,
        ),
    ]
    result = subprocess.run(
        command,
        check=False,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    summary = json.loads((tmp_path / "run.json").read_text())
    assert (summary["engine"], summary["world_size"], summary["global_step"]) == (
        "deepspeed.runtime.engine.DeepSpeedEngine",
        1,
        2,
    )
    # The embedded T5 is built from its config: its loss covers the batch's tokens (textsql.training.loss).
    assert summary["loss_vocabulary"] == "batch"

    again = subprocess.run(
        command,
        check=False,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=REFUSAL_S,
    )
    assert again.returncode == 1
    assert "holds a previous run" in again.stderr and "--resume-from-checkpoint auto" in again.stderr
    assert (tmp_path / "checkpoint-2").is_dir() and (tmp_path / "model" / "model.safetensors").is_file()


def test_token_budget_batches_train_on_two_ranks_with_a_bounded_generation_and_a_clean_exit(prepared_data, tmp_path):
    output = tmp_path / "run"
    result = launch(prepared_data, output, "zero1", "--max_tokens_per_batch", "1024")
    log = result.stdout + result.stderr
    summary = json.loads((output / "run.json").read_text())
    assert summary["global_step"] == STEPS and summary["world_size"] == RANKS
    losses = [entry["loss"] for entry in summary["log_history"] if "loss" in entry]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), losses
    saved = json.loads((output / "model" / "generation_config.json").read_text())
    assert saved["max_new_tokens"] <= 24 and "max_length" not in saved
    assert "seem to have been set" not in log
    assert "destroy_process_group" not in log
