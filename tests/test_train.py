"""textsql.training.train without starting ranks: strict parsing, precision rules, output directory, checkpoints."""

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.launch import fake_prepared

from textsql.arguments import RunArguments, train_argv
from textsql.cli import cli
from textsql.errors import DataError, LaunchError, ModelError, ProfileError, RenamedOptionError
from textsql.planning.train_args import parse_command_line, resolve_precision
from textsql.rundir.checkpoints import (
    CHECKPOINT_PREFIX,
    COMPLETE_MARKER,
    checkpoint_dirs,
    is_complete_checkpoint,
    newest_complete_checkpoint,
    set_aside_incomplete,
)
from textsql.training.output_dir import _prepare_on_saving_rank

REQUIRED = train_argv(data_dir="data", run_dir="out")


def parse(*flags: str):
    return parse_command_line([*REQUIRED, *flags])


def test_a_typo_fails_and_names_the_flag_meant():
    with pytest.raises(LaunchError, match=r"'--lerning_rate'.*did you mean --learning_rate"):
        parse("--lerning_rate", "1e-3")


def test_abbreviations_are_not_guessed():
    with pytest.raises(LaunchError, match="--learning"):
        parse("--learning", "1e-3")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--gradient_checkpointing", "false"], False),
        (["--gradient_checkpointing", "False"], False),
        (["--gradient-checkpointing", "true"], True),
        (["--gradient_checkpointing"], True),
        ([], None),  # unset: the trainer decides (off)
    ],
)
def test_booleans_mean_what_they_say(flags, expected):
    assert parse(*flags)[3]["gradient_checkpointing"] is expected


def test_a_bad_boolean_is_one_line():
    with pytest.raises(LaunchError, match="gradient_checkpointing.*fals") as error:
        parse("--gradient_checkpointing", "fals")
    assert "\n" not in str(error.value)


def test_the_launchers_local_rank_is_accepted():
    assert parse("--local_rank=1")[3]["local_rank"] == 1


def test_the_profile_and_overlay_become_the_deepspeed_config():
    _, _, run_args, training = parse("--profile", "zero3", "--overlay", "flops_profiler")
    assert run_args.profile == "zero3"
    assert training["deepspeed"]["zero_optimization"]["stage"] == 3
    assert training["deepspeed"]["flops_profiler"]["enabled"] is True
    assert training["accelerator_config"]["use_configured_state"] is True


def test_unknown_profile_fails_before_anything_starts():
    with pytest.raises(ProfileError, match="zero3_offload"):
        parse("--profile", "zero4")


@pytest.mark.parametrize(
    ("flag", "replacement"),
    [
        (["--deepspeed", "ds.json"], "--profile"),
        (["--bf16", "true"], "--precision bf16"),
    ],
)
def test_flags_this_program_sets_are_refused_with_the_one_to_use(flag, replacement):
    with pytest.raises(LaunchError, match=replacement):
        parse(*flag)


def test_missing_data_and_run_dirs_name_the_flag():
    with pytest.raises(DataError, match="--data-dir"):
        parse_command_line(["--run_dir", "out"])
    with pytest.raises(LaunchError, match="--run-dir"):
        parse_command_line(["--data_dir", "data"])


@pytest.mark.parametrize(
    ("old", "usage"),
    [
        (["--output-dir", "out"], "--run-dir DIR"),
        (["--output_dir=out"], "--run-dir DIR"),
        (["--resume", "auto"], "--resume-from-checkpoint auto|PATH"),
    ],
)
def test_the_previous_releases_flags_are_refused_with_their_new_spelling(old, usage):
    with pytest.raises(
        RenamedOptionError, match=f"^{old[0].split('=')[0]} was renamed {usage.split()[0]}: textsql train {usage}$"
    ):
        parse_command_line(["--data-dir", "data", *old])
    result = CliRunner().invoke(cli, ["train", "--data-dir", "data", *old])
    assert result.exit_code == 2 and f"was renamed {usage.split()[0]}" in result.output, result.output


def test_resume_from_checkpoint_is_the_trainers_own_field():
    *_, training = parse("--resume-from-checkpoint", "auto")
    assert training["resume_from_checkpoint"] == "auto"
    assert train_argv(resume_from_checkpoint="auto") == ["--resume-from-checkpoint", "auto"]
    with pytest.raises(LaunchError, match="did you mean run_dir"):
        train_argv(output_dir="out")


def test_fp16_is_refused_for_t5_unless_forced():
    with pytest.raises(ModelError, match="overflows in fp16.*--force-fp16") as error:
        parse("--precision", "fp16")
    assert "\n" not in str(error.value)
    model_args, _, _, training = parse("--precision", "fp16", "--force_fp16", "true")
    assert (model_args.precision, training["fp16"], training["bf16"]) == ("fp16", True, False)


def test_auto_precision_is_fp32_without_a_bf16_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model_args, _, _, training = parse()
    assert (model_args.precision, training["bf16"], training["fp16"]) == ("fp32", False, False)


def test_auto_precision_is_bf16_on_a_gpu_that_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_precision("auto") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_precision("auto") == "fp32"
    assert resolve_precision("bf16") == "bf16"


def test_resume_and_overwrite_contradict():
    with pytest.raises(LaunchError, match="--resume-from-checkpoint and --overwrite-output-dir"):
        parse("--resume-from-checkpoint", "auto", "--overwrite_output_dir", "true")


def fake_checkpoint(output, step: int, complete: bool = True):
    checkpoint = output / f"checkpoint-{step}"
    (checkpoint / f"global_step{step}").mkdir(parents=True)
    (checkpoint / "latest").write_text(f"global_step{step}")
    if complete:
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (checkpoint / COMPLETE_MARKER).write_text(f"global step {step}\n")
    return checkpoint


def test_newest_complete_checkpoint_skips_one_cut_off_while_saving(tmp_path):
    assert newest_complete_checkpoint(tmp_path / "missing") is None
    fake_checkpoint(tmp_path, 5)
    fake_checkpoint(tmp_path, 10)
    cut_off = fake_checkpoint(tmp_path, 15, complete=False)
    assert not is_complete_checkpoint(cut_off)
    assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


def test_checkpoints_are_listed_in_the_trainers_own_order(tmp_path):
    """checkpoints.py lists them without transformers (the supervisor's import stays light): the same dirs, same order."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

    for step in (100, 9, 20):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-7").write_text("a file, not a checkpoint")
    (tmp_path / "incomplete-checkpoint-50").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    assert CHECKPOINT_PREFIX == PREFIX_CHECKPOINT_DIR
    assert [str(path) for path in checkpoint_dirs(tmp_path)] == sort_checkpoints(str(tmp_path))
    assert [path.name for path in checkpoint_dirs(tmp_path)] == ["checkpoint-9", "checkpoint-20", "checkpoint-100"]


def test_a_checkpoint_not_every_rank_finished_is_set_aside(tmp_path, caplog):
    fake_checkpoint(tmp_path, 5)
    unmarked = fake_checkpoint(tmp_path, 10)
    (unmarked / COMPLETE_MARKER).unlink()  # rank 0 wrote `latest`, another rank was still writing
    assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")
    assert set_aside_incomplete(tmp_path) == [tmp_path / "incomplete-checkpoint-10"]
    assert "set aside incomplete checkpoint" in caplog.text and "marker" in caplog.text
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-5", "incomplete-checkpoint-10"]


@pytest.mark.parametrize(
    ("latest", "reason"),
    [
        (b"", "names no state directory ('')"),
        (b"\n", "names no state directory ('')"),
        (b"\xff\xfe", "is not text"),
        (b"..", "names no state directory ('..')"),
        (b"global_step99", "names 'global_step99', which is missing"),
    ],
)
def test_a_checkpoint_with_a_broken_latest_tag_is_skipped_and_named(tmp_path, caplog, latest, reason):
    fake_checkpoint(tmp_path, 10)
    broken = fake_checkpoint(tmp_path, 15)
    (broken / "latest").write_bytes(latest)
    assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    assert f"skipping checkpoint {broken}: its 'latest' file {reason}" in caplog.text


def test_a_previous_run_is_kept_unless_asked(tmp_path):
    fake_checkpoint(tmp_path, 5)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(LaunchError, match="--resume-from-checkpoint auto.*--overwrite-output-dir"):
        _prepare_on_saving_rank(tmp_path, None, RunArguments())
    assert (tmp_path / "checkpoint-5").is_dir()

    _prepare_on_saving_rank(tmp_path, "auto", RunArguments())
    assert (tmp_path / "checkpoint-5").is_dir()

    _prepare_on_saving_rank(tmp_path, None, RunArguments(overwrite_output_dir=True))
    assert not (tmp_path / "checkpoint-5").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_cli_train_errors_are_one_line_without_traceback():
    from click.testing import CliRunner

    from textsql.cli import cli

    result = CliRunner().invoke(cli, ["train", "--data_dir", "data", "--run_dir", "out", "--lerning_rate", "1e-3"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: unknown argument '--lerning_rate' (did you mean --learning_rate?); see `textsql train --help`"
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"profile": "zero9"}, "Error: unknown profile 'zero9'"),
        ({"model": "./no-such-model"}, "Error: model directory './no-such-model' does not exist"),
        ({"data_dir": "missing"}, "Error: no prepared dataset at 'missing'"),
    ],
)
def test_textsql_launch_refuses_before_any_rank_starts(tmp_path, monkeypatch, values, message):
    from click.testing import CliRunner

    from textsql.cli import cli

    monkeypatch.chdir(tmp_path)
    fake_prepared(tmp_path / "data")
    run_dir = tmp_path / "run"
    train_args = train_argv(**({"data_dir": "data"} | values))
    result = CliRunner().invoke(cli, ["launch", "--run-dir", str(run_dir), "--launcher", "local", "--", *train_args])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith(message), result.output
    # launch() creates the run directory before anything else (launch.log, .deepspeed_env, the ranks).
    assert not run_dir.exists()


@pytest.mark.parametrize("spelling", ["--run-dir", "--run_dir", "--run-dir="])
def test_textsql_launch_refuses_a_second_run_dir_that_differs_naming_both(tmp_path, monkeypatch, spelling):
    from click.testing import CliRunner

    from textsql.cli import cli

    monkeypatch.chdir(tmp_path)
    fake_prepared(tmp_path / "data")
    second = [f"{spelling}runs/b"] if spelling.endswith("=") else [spelling, "runs/b"]
    result = CliRunner().invoke(
        cli, ["launch", "--run-dir", "runs/a", "--launcher", "local", "--", "--data-dir", "data", *second]
    )
    assert result.exit_code == 1
    refusal = "--run-dir 'runs/b' after -- differs from the launch's --run-dir 'runs/a'; give the run directory once"
    assert result.output.strip().splitlines() == [f"Error: {refusal}, before --"]
    assert not (tmp_path / "runs").exists(), "nothing written to either directory"


def test_the_launch_run_dir_is_the_ranks_given_once_or_twice_alike(tmp_path):
    from textsql.launching.command import LaunchArguments
    from textsql.launching.training_plan import TrainingPlan

    data = fake_prepared(tmp_path / "data")
    once = TrainingPlan.read(LaunchArguments(run_dir=tmp_path / "run", train_args=train_argv(data_dir=data)))
    assert once.output_dir == tmp_path / "run"
    assert once.rank_args[:2] == ("--run-dir", str(tmp_path / "run")), "the ranks get the launch's run directory"
    # The same directory spelt another way after -- is no mismatch.
    twice = LaunchArguments(run_dir=tmp_path / "run", train_args=train_argv(data_dir=data, run_dir=f"{tmp_path}/./run"))
    assert TrainingPlan.read(twice).output_dir.resolve() == (tmp_path / "run").resolve()


def test_train_argv_refuses_a_name_that_is_no_argument():
    with pytest.raises(
        LaunchError, match="unknown training argument 'lerning_rate' \\(did you mean learning_rate\\?\\)"
    ):
        train_argv(lerning_rate=1e-3)
    assert train_argv(overlay=[], resume_from_checkpoint=None, overwrite_output_dir=False) == [
        "--overwrite-output-dir",
        "false",
    ]


def test_evaluation_share_counts_the_evaluations_inside_the_training_loop_only():
    from textsql.training.train import evaluation_share

    history = [
        {"loss": 3.0, "step": 10},
        {"eval_loss": 2.0, "eval_runtime": 4.0, "step": 10},
        {"eval_loss": 1.5, "eval_runtime": 6.0, "step": 20},
        {"train_runtime": 200.0, "step": 20},
        {"eval_loss": 1.5, "eval_runtime": 30.0, "step": 20},  # the final evaluation, after the loop
    ]
    assert evaluation_share(history) == 0.05
    assert evaluation_share(history[:3]) is None


@pytest.mark.parametrize("pinned", [False, True])
def test_pinned_batches_reach_the_device_without_blocking(tmp_path, pinned):
    """accelerate copies a prepared loader's batches with non_blocking only when told; pinning is what makes that
    asynchronous, so the two go together (pinned on CUDA by default, not on CPUs)."""
    from transformers import Seq2SeqTrainingArguments

    from textsql.model import load_model
    from textsql.training.batching import TokenBudgetTrainer

    *_, values = parse("--eval_strategy", "no", *(["--dataloader_pin_memory", "true"] if pinned else []))
    # The run's own values, less DeepSpeed (its config needs the launcher's world) and the shared state.
    values.pop("deepspeed")
    values["accelerator_config"].pop("use_configured_state")
    trainer = TokenBudgetTrainer(model=load_model(), args=Seq2SeqTrainingArguments(**values))
    loader = trainer.accelerator.prepare(torch.utils.data.DataLoader(list(range(4)), batch_size=2))
    assert trainer.accelerator.non_blocking is pinned and loader._non_blocking is pinned
