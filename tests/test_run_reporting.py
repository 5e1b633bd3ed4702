"""What a run trains with and reports: the recipe by what the model is, grad_norm without a per-step host sync,
questions and tokens per second of the batches that ran, and evaluation's generate under training's autocast."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import pytest
import torch

from bench.tiny_run import tiny_run_argv
from textsql.arguments import train_argv
from textsql.model import load_model, load_tokenizer
from textsql.planning.recipe import FROM_CONFIG_RECIPE, WITH_WEIGHTS_RECIPE
from textsql.planning.train_args import parse_command_line
from textsql.training.batching import TokenBudgetBatchSampler, TokenBudgetTrainer

SYNC_OP = "aten::_local_scalar_dense"  # what .item() and every other host read of a tensor dispatch
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def model_with_weights(tmp_path_factory) -> Path:
    """The embedded small T5 saved with its weights: a model directory as a trained model/ or a hub download is."""
    target = tmp_path_factory.mktemp("weights") / "model"
    load_model().save_pretrained(target)
    load_tokenizer().save_pretrained(target)
    return target


def parsed(**values):
    _, _, run_args, training = parse_command_line(train_argv(data_dir="data", run_dir="out", **values))
    return run_args.recipe, training


def test_a_model_with_weights_gets_the_pretrained_recipe_and_one_from_its_config_the_demos(model_with_weights):
    recipe, training = parsed(model=model_with_weights, profile="zero0")
    assert (recipe["name"], training["learning_rate"], training["lr_scheduler_type"], training["warmup_steps"]) == (
        WITH_WEIGHTS_RECIPE.name,
        3e-4,
        "linear",
        0.06,
    )
    assert recipe["overridden"] == [] and "transformers' T5 documentation" in recipe["why"]
    recipe, training = parsed(profile="zero0")
    assert (recipe["name"], training["learning_rate"], training["lr_scheduler_type"], training["warmup_steps"]) == (
        FROM_CONFIG_RECIPE.name,
        1e-3,
        "warmup_stable_decay",
        0,
    )


def test_every_flag_given_wins_even_one_equal_to_a_default(model_with_weights):
    # 1e-3 is the other recipe's rate and 0 warm-up the trainer's own default: typed, they still win.
    recipe, training = parsed(model=model_with_weights, profile="zero0", learning_rate=1e-3, warmup_steps=0)
    assert (training["learning_rate"], training["warmup_steps"], training["lr_scheduler_type"]) == (1e-3, 0, "linear")
    assert recipe["overridden"] == ["learning_rate", "warmup_steps"] and recipe["peak_learning_rate"] == 1e-3


def sync_count(action) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        action()
    return sum(event.count for event in profiler.key_averages() if event.key == SYNC_OP)


def test_grad_norm_is_read_from_the_clipping_hook_at_logging_steps_only(tmp_path):
    """Under DeepSpeed with the optimizer clipping (bf16 autocast), the trainer is handed no norm (None): the hook's
    tensor stands in, and is read on the host only when a step logs."""
    from transformers import Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

    # The fused AdamW of a GPU run (torch's unfused one reads each parameter's step count on the host).
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), max_grad_norm=0.0, report_to=[], optim="adamw_torch_fused", use_cpu=True
    )
    # A T5 of one tiny layer: what is counted is reads per step, which the model's size does not change.
    model = T5ForConditionalGeneration(
        T5Config(vocab_size=16, d_model=8, d_ff=16, d_kv=4, num_heads=2, num_layers=1, decoder_start_token_id=0)
    )
    trainer = TokenBudgetTrainer(model=model, args=args, optimizer_max_grad_norm=1.0)
    optimizer = trainer.create_optimizer()
    batch = {"input_ids": torch.tensor([[5, 6, 1]]), "labels": torch.tensor([[7, 1]])}
    tr_loss = torch.zeros(())
    # What trainer.train() sets up before its loop.
    trainer._globalstep_last_logged, trainer._total_loss_scalar, trainer.current_flos = 0, 0.0, 0

    def step(log: bool | None, stepping: torch.optim.Optimizer = optimizer) -> None:
        loss = model(**batch).loss
        loss.backward()
        tr_loss.add_(loss.detach())
        stepping.step()
        stepping.zero_grad()
        trainer.state.global_step += 1
        if log is not None:
            trainer.control.should_log = log
            trainer._maybe_log_save_evaluate(tr_loss, None, model, None, 0.0, None, time.time(), learning_rate=1e-3)

    # Before: the same steps by an optimizer of the same kind without the hook, and no trainer logging after them
    # (on a CPU, fused AdamW reads a few scalars of its own each step; on CUDA it reads none).
    unhooked = torch.optim.AdamW(model.parameters(), fused=True)
    optimizer_alone = sync_count(lambda: [step(None, unhooked) for _ in range(4)])
    steps_without_log = sync_count(lambda: [step(log=False) for _ in range(4)])
    logging_step = sync_count(lambda: step(log=True))
    assert steps_without_log == optimizer_alone
    # The loss's own read (the trainer's) and the norm's: one each.
    assert logging_step == optimizer_alone // 4 + 2
    logged = trainer.state.log_history[-1]
    assert logged["grad_norm"] == pytest.approx(float(trainer.clipping.norm)) and logged["grad_norm"] > 0


@pytest.mark.slow
def test_a_short_run_with_weights_records_its_recipe_warms_up_logs_grad_norm_and_counts_its_batches(
    tmp_path, model_with_weights, prepared_sample
):
    """One DeepSpeed rank, bf16 autocast at stage 0 (the optimizer clips), token-budget batches, every step logged."""
    budget = 2048
    train = datasets.load_from_disk(str(prepared_sample))["train"]
    sampler = TokenBudgetBatchSampler(
        [len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]], budget
    )
    # Whole epochs: every question comes once an epoch, so the questions that ran are known exactly.
    epochs = 3
    steps = epochs * len(sampler)
    output = tmp_path / "run"
    argv = tiny_run_argv(
        prepared_sample,
        output,
        max_steps=steps,
        eval_every=None,
        model=model_with_weights,
        profile="zero0",
        precision="bf16",
        max_tokens_per_batch=budget,
        per_device_train_batch_size=2,
        save_strategy="no",
        max_eval_samples=4,
        predict_with_generate=False,
    )
    result = subprocess.run(
        [sys.executable, "-m", "textsql.training.train", *argv],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    summary = json.loads((output / "run.json").read_text())
    assert summary["recipe"]["name"] == WITH_WEIGHTS_RECIPE.name and summary["recipe"]["overridden"] == []
    steps_logged = [entry for entry in summary["log_history"] if "loss" in entry]
    rates = [entry["learning_rate"] for entry in steps_logged]
    warmup = -(-steps * 6 // 100)  # ceil(6 % of the steps)
    # The trainer logs each step's rate before stepping the schedule: 0 at the first step, the peak after warm-up.
    assert rates[0] == 0 and rates[warmup] == pytest.approx(WITH_WEIGHTS_RECIPE.learning_rate) == max(rates)
    assert rates[-1] < rates[warmup]
    assert all(entry["grad_norm"] > 0 for entry in steps_logged)
    throughput = summary["throughput"]
    trainer_figure = next(entry for entry in summary["log_history"] if "train_samples_per_second" in entry)
    assert throughput["questions"] == epochs * len(train)
    # The trainer's own figure counts 2 questions a step, what per_device_train_batch_size says.
    assert trainer_figure["train_samples_per_second"] * trainer_figure["train_runtime"] == pytest.approx(
        2 * steps, rel=0.02
    )
    assert throughput["questions"] > 4 * steps
    assert 0 < throughput["tokens"] < throughput["padded_tokens"]


AUTOCAST_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import deepspeed, torch
    from transformers import Seq2SeqTrainingArguments
    from textsql.model import load_model
    from textsql.training.batching import TokenBudgetTrainer
    from worker.network import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    model = load_model()
    config = {"train_batch_size": 1, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    args = Seq2SeqTrainingArguments(output_dir=sys.argv[1], report_to=[], predict_with_generate=True,
                                    generation_max_length=4, use_cpu=True)
    trainer = TokenBudgetTrainer(model=model, args=args)
    trainer.model_wrapped = engine  # as trainer.train() leaves it
    dtypes = set()
    model.lm_head.register_forward_hook(lambda module, inputs, output: dtypes.add(str(output.dtype)))
    model.eval()
    inputs = {"input_ids": torch.tensor([[5, 6, 1]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
              "labels": torch.tensor([[7, 1]])}
    trainer.prediction_step(engine, inputs, prediction_loss_only=False)
    print(json.dumps(sorted(dtypes)))
    """
)


@pytest.mark.slow
def test_evaluations_generate_runs_under_the_engines_bf16_autocast(tmp_path):
    """The engine autocasts its own forward (the evaluation loss); generate, called on the unwrapped model,
    runs under the same autocast: the output layer's matmuls give bf16, none fp32."""
    result = subprocess.run(
        [sys.executable, "-c", AUTOCAST_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["torch.bfloat16"]


def test_a_model_from_its_config_batched_to_a_token_budget_warms_up_to_a_rate_scaled_to_the_batch():
    """A GPU's default batches (hundreds of questions a step) from random weights: the rate, scaled by the square root
    of the tokens a step over the demo's 2,560, is reached by a warm-up, then held and decayed; without a token budget
    (the CPU demo) the demo's rate is held from the first step."""
    from textsql.planning.recipe import FROM_CONFIG_TOKEN_BATCHES_RECIPE

    recipe, training = parsed(profile="zero0", max_tokens_per_batch=10240)
    assert (recipe["name"], training["learning_rate"], training["lr_scheduler_type"], training["warmup_steps"]) == (
        FROM_CONFIG_TOKEN_BATCHES_RECIPE.name,
        2 * FROM_CONFIG_RECIPE.learning_rate,  # 4 times the demo's tokens a step
        "warmup_stable_decay",
        0.06,
    )
    assert recipe["overridden"] == [] and parsed(profile="zero0")[0]["name"] == FROM_CONFIG_RECIPE.name
    # A rate given on the command line is kept, and recorded as given.
    recipe, training = parsed(profile="zero0", max_tokens_per_batch=10240, learning_rate=5e-4)
    assert (training["learning_rate"], recipe["overridden"]) == (5e-4, ["learning_rate"])


@pytest.mark.parametrize(
    ("budget", "accumulation", "world", "rate"),
    [
        (8192, 1, "4", 3.58e-3),  # four ranks of 8,192 tokens step 32,768: the rate measured there
        (8192, 2, "2", 3.58e-3),  # so do two ranks accumulating two batches each
        (32768, 1, "8", 3.58e-3),  # 262,144 tokens: raised no further than measured
        (1024, 1, "1", 1e-3),  # fewer tokens than the demo's: its rate, never lowered
    ],
)
def test_the_scaled_rate_counts_every_rank_and_accumulated_batch_of_a_step(
    monkeypatch, budget, accumulation, world, rate
):
    monkeypatch.setenv("WORLD_SIZE", world)  # as DeepSpeed's launcher gives each rank
    recipe, training = parsed(profile="zero0", max_tokens_per_batch=budget, gradient_accumulation_steps=accumulation)
    assert (training["learning_rate"], recipe["peak_learning_rate"]) == (rate, rate)


def recipe_rates(tmp_path, recipe, steps: int, given: dict) -> list[float]:
    """The rate at each of ``steps`` steps of ``textsql train``'s trainer under ``recipe``."""
    from transformers import Seq2SeqTrainingArguments

    from textsql.training.trainer import ResumableTrainer

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        report_to=[],
        use_cpu=True,
        lr_scheduler_kwargs=given,
        **recipe.training_values(),
    )
    trainer = ResumableTrainer(model=load_model(), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    return rates


@pytest.mark.parametrize("given", [{}, {"num_decay_steps": 5}])
def test_the_demos_rate_is_held_then_decays_to_zero_over_the_last_fifth_unless_told(tmp_path, given):
    rates = recipe_rates(tmp_path, FROM_CONFIG_RECIPE, 10, given)
    decay = given.get("num_decay_steps", 2)  # a fifth of 10
    assert rates[: 10 - decay] == [pytest.approx(1e-3)] * (10 - decay)
    assert rates[10 - decay :] == sorted(rates[10 - decay :], reverse=True) and rates[-1] < 1e-3


def test_token_batches_from_random_weights_warm_up_then_hold_and_decay_as_the_demo_does(tmp_path):
    from textsql.planning.recipe import FROM_CONFIG_TOKEN_BATCHES_RECIPE

    peak = FROM_CONFIG_TOKEN_BATCHES_RECIPE.learning_rate
    rates = recipe_rates(tmp_path, FROM_CONFIG_TOKEN_BATCHES_RECIPE, 50, {})
    warmup, decay = 3, 10  # 6 % and a fifth of 50 steps
    assert rates[:warmup] == sorted(rates[:warmup]) and rates[0] < rates[warmup - 1] < peak
    assert rates[warmup : 50 - decay] == [pytest.approx(peak)] * (50 - warmup - decay)
    assert rates[50 - decay :] == sorted(rates[50 - decay :], reverse=True) and rates[-1] < peak / 5
