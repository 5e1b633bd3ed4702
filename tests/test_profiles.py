"""DeepSpeed profiles: names, overlays, errors, acceptance by DeepSpeed's own config parser, and one
place for them: a new JSON file is a new profile in the estimate, the CLI, notebook 02 and the bench."""

import json
import shutil

import nbformat
import pytest
from click.testing import CliRunner
from transformers import Seq2SeqTrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from bench import profiles as bench_profiles
from textsql.cli import cli
from textsql.constants import DSCONFIG_DIR_VAR
from textsql.errors import ProfileError
from textsql.model import load_model
from textsql.pipeline.parameters import notebook_path
from textsql.planning.estimate import GIB, estimate, format_estimate
from textsql.planning.profiles import (
    DSCONFIG_DIR,
    autocast_bf16,
    available_overlays,
    available_profiles,
    get_profile,
    load_profile,
    merge,
    profile_path,
    profiles,
)

PROFILES = ("zero0", "zero1", "zero2", "zero3", "zero3_offload")


def test_the_five_profiles_are_shipped_cheapest_first():
    assert available_profiles() == list(PROFILES)
    assert "flops_profiler" in available_overlays()


def test_unknown_profile_names_the_available_ones():
    with pytest.raises(ProfileError) as error:
        load_profile("zero9")
    assert "'zero9'" in str(error.value)
    assert all(name in str(error.value) for name in PROFILES)


def test_unknown_overlay_names_the_available_ones():
    with pytest.raises(ProfileError, match="flops_profiler"):
        load_profile("zero1", ["flops"])


def test_a_profile_path_and_a_broken_file(tmp_path):
    custom = tmp_path / "custom.json"
    custom.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert profile_path(str(custom)) == custom.resolve()
    assert load_profile(str(custom))["zero_optimization"]["stage"] == 2
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ProfileError, match="broken.json"):
        load_profile(str(broken))


def test_merge_is_deep_and_leaves_its_inputs_alone():
    base = {"zero_optimization": {"stage": 3, "overlap_comm": True}, "steps_per_print": 10}
    merged = merge(base, {"zero_optimization": {"stage": 2}, "flops_profiler": {"enabled": True}})
    assert merged == {
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "steps_per_print": 10,
        "flops_profiler": {"enabled": True},
    }
    assert base["zero_optimization"]["stage"] == 3


@pytest.fixture(scope="module")
def trainer_arguments(tmp_path_factory):
    # Single process, no deepspeed= here: only the values the trainer substitutes for "auto" matter.
    return Seq2SeqTrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("args")),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-4,
        max_grad_norm=0.5,
        report_to="none",
    )


@pytest.mark.parametrize("name", PROFILES)
def test_deepspeed_accepts_each_profile_after_the_trainer_fills_auto(name, trainer_arguments):
    from deepspeed.runtime.config import DeepSpeedConfig

    hf_config = HfTrainerDeepSpeedConfig(load_profile(name, ["flops_profiler"]))
    hf_config.trainer_config_process(trainer_arguments)
    hf_config.trainer_config_finalize(trainer_arguments, load_model(), num_training_steps=100)
    assert '"auto"' not in json.dumps(hf_config.config)

    config = DeepSpeedConfig(hf_config.config)
    assert config.zero_optimization_stage == get_profile(name).stage
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)
    assert config.gradient_clipping == 0.5
    assert config.flops_profiler_config.enabled
    # DeepSpeed's throughput timer synchronizes the device twice a step to time it; nothing here reads it.
    assert not config.timers_config.enabled
    offloaded = name == "zero3_offload"
    assert (config.zero_config.offload_optimizer is not None) is offloaded
    assert (config.zero_config.offload_param is not None) is offloaded
    if offloaded:
        assert config.optimizer_params["lr"] == 3e-4
    if name.startswith("zero3"):
        assert config.zero_config.gather_16bit_weights_on_model_save


def test_each_profile_says_its_stage_offload_and_precision():
    facts = {profile.name: (profile.stage, profile.offload_optimizer, profile.offload_params) for profile in profiles()}
    assert facts == {
        "zero0": (0, False, False),
        "zero1": (1, False, False),
        "zero2": (2, False, False),
        "zero3": (3, False, False),
        "zero3_offload": (3, True, True),
    }
    assert all(profile.precision == {"bf16": "auto", "fp16": "auto"} for profile in profiles())


@pytest.fixture
def sixth_profile(tmp_path, monkeypatch):
    """A copy of dsconfig/ plus one new file, zero2_offload.json, made the profile directory."""
    directory = tmp_path / "dsconfig"
    shutil.copytree(DSCONFIG_DIR, directory)
    config = load_profile("zero2")
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    (directory / "zero2_offload.json").write_text(json.dumps(config))
    monkeypatch.setenv(DSCONFIG_DIR_VAR, str(directory))
    return "zero2_offload"


def test_a_sixth_json_file_is_a_profile_everywhere(sixth_profile):
    assert available_profiles() == ["zero0", "zero1", "zero2", sixth_profile, "zero3", "zero3_offload"]
    assert load_profile(sixth_profile)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"

    report = estimate(None, nodes=1, gpus_per_node=2, gpu_memory_gb=16)
    row = report["profiles"][sixth_profile]
    assert (row["zero_stage"], row["offload"]) == (2, "optimizer")
    assert row["gpu_gb_per_rank"] == round(2 * report["parameters"] / GIB, 3), (
        "offloaded ZeRO-2 keeps only 16-bit weights on the GPU"
    )
    # Notebook 02's table is format_estimate over that report.
    source = "".join(cell.source for cell in nbformat.read(notebook_path("02_train_distributed"), as_version=4).cells)
    assert "report = workers_estimate(" in source and "format_estimate(report" in source
    assert any(line.split()[:3] == [sixth_profile, "2", "optimizer"] for line in format_estimate(report).splitlines())

    assert f"|{sixth_profile}|" in CliRunner().invoke(cli, ["estimate", "--help"]).output
    chosen = CliRunner().invoke(cli, ["estimate", "--gpu-memory-gb", "16", "--profile", sixth_profile, "--json"])
    assert chosen.exit_code == 0, chosen.output
    assert list(json.loads(chosen.stdout)["profiles"]) == [sixth_profile]

    assert sixth_profile in bench_profiles.Sizes().names()


def test_the_cli_refuses_an_unknown_profile_with_the_choices():
    result = CliRunner().invoke(cli, ["estimate", "--gpu-memory-gb", "16", "--profile", "zero9"])
    assert result.exit_code == 2
    assert "unknown profile 'zero9'" in result.output and "zero3_offload" in result.output


def test_a_stage_deepspeed_does_not_have_is_refused(tmp_path):
    bad = tmp_path / "zero5.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    with pytest.raises(ProfileError, match="zero_optimization.stage 5"):
        get_profile(str(bad))


def test_a_precision_the_profile_fixes_otherwise_is_refused(tmp_path):
    fixed = tmp_path / "bf16_only.json"
    fixed.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}))
    profile = get_profile(str(fixed))
    profile.check_precision("bf16")
    with pytest.raises(
        ProfileError, match=r'fixes bf16.enabled to true but the run uses fp32.*"auto".*--precision bf16'
    ):
        profile.check_precision("fp32")


@pytest.mark.parametrize("name", [name for name in PROFILES if get_profile(name).stage > 0])
def test_bucket_sizes_are_explicit_not_the_trainers_d_model_squared(name, trainer_arguments):
    """transformers fills "auto" with d_model^2 (262,144 elements for t5-small: ~230 reduce calls a step)."""
    hf_config = HfTrainerDeepSpeedConfig(load_profile(name))
    hf_config.trainer_config_process(trainer_arguments)
    hf_config.trainer_config_finalize(trainer_arguments, load_model(), num_training_steps=100)
    zero = hf_config.config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 50_000_000
    if get_profile(name).stage < 3:  # ZeRO-3 gathers parameters by its prefetch bucket instead
        assert zero["allgather_bucket_size"] == 50_000_000


def test_bf16_at_stage_0_runs_under_torch_autocast_and_the_optimizer_clips(trainer_arguments):
    """At stage 0 DeepSpeed's bf16 wraps the trainer's optimizer in FP16_UnfusedOptimizer (a loop over
    every tensor with a host read each); torch autocast leaves the fused optimizer unwrapped."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config, clip_in_optimizer = autocast_bf16(load_profile("zero0"))
    assert clip_in_optimizer and config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert not {"bf16", "fp16"} & set(config) and "bf16" in load_profile("zero0")
    # textsql.training.train hands the trainer max_grad_norm 0 (the optimizer clips), so "auto" becomes 0.
    arguments = Seq2SeqTrainingArguments(output_dir=trainer_arguments.output_dir, max_grad_norm=0.0, report_to="none")
    hf_config = HfTrainerDeepSpeedConfig(config)
    hf_config.trainer_config_process(arguments)
    hf_config.trainer_config_finalize(arguments, load_model(), num_training_steps=100)
    parsed = DeepSpeedConfig(hf_config.config)
    assert parsed.torch_autocast_enabled and not parsed.bfloat16_config.enabled and parsed.gradient_clipping == 0
    for name in ("zero1", "zero2", "zero3", "zero3_offload"):  # ZeRO's own optimizers, or a DeepSpeed optimizer
        assert autocast_bf16(load_profile(name)) == (load_profile(name), False)
