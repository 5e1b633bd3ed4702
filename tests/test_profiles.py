"""DeepSpeed profiles: names, overlays, errors, and acceptance by DeepSpeed's own config parser."""
import json

import pytest
from transformers import Seq2SeqTrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from textsql.errors import ProfileError
from textsql.model import load_model
from textsql.profiles import available_overlays, available_profiles, load_profile, merge, profile_path

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
    assert merged == {"zero_optimization": {"stage": 2, "overlap_comm": True}, "steps_per_print": 10, "flops_profiler": {"enabled": True}}
    assert base["zero_optimization"]["stage"] == 3


@pytest.fixture(scope="module")
def trainer_arguments(tmp_path_factory):
    # Single process, no deepspeed= here: only the values the trainer substitutes for "auto" matter.
    return Seq2SeqTrainingArguments(
        output_dir=str(tmp_path_factory.mktemp("args")), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-4, max_grad_norm=0.5, report_to="none",
    )


@pytest.mark.parametrize("name", PROFILES)
def test_deepspeed_accepts_each_profile_after_the_trainer_fills_auto(name, trainer_arguments):
    from deepspeed.runtime.config import DeepSpeedConfig

    hf_config = HfTrainerDeepSpeedConfig(load_profile(name, ["flops_profiler"]))
    hf_config.trainer_config_process(trainer_arguments)
    hf_config.trainer_config_finalize(trainer_arguments, load_model(), num_training_steps=100)
    assert '"auto"' not in json.dumps(hf_config.config)

    config = DeepSpeedConfig(hf_config.config)
    assert config.zero_optimization_stage == int(name[4])
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)
    assert config.gradient_clipping == 0.5
    assert config.flops_profiler_config.enabled
    offloaded = name == "zero3_offload"
    assert (config.zero_config.offload_optimizer is not None) is offloaded
    assert (config.zero_config.offload_param is not None) is offloaded
    if offloaded:
        assert config.optimizer_params["lr"] == 3e-4
    if name.startswith("zero3"):
        assert config.zero_config.gather_16bit_weights_on_model_save
