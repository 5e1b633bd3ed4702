"""textsql estimate: parameters from the config alone, DeepSpeed's estimators, the cheapest profile that fits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import AutoConfig, AutoModelForSeq2SeqLM

from textsql.cli import cli
from textsql.constants import ASSETS_DIR
from textsql.errors import ProfileError
from textsql.model import load_config, load_model
from textsql.planning.estimate import (
    GIB,
    choose_profile,
    count_parameters,
    estimate,
    format_estimate,
    resolve_profile,
    resolve_profile_here,
    t5_parameters,
)

T5_SMALL_PARAMETERS = 60_506_624  # t5-small as published (tied embeddings counted once)


def test_parameters_come_from_the_config_and_match_the_built_model():
    total, largest = count_parameters(load_config(None))
    assert total == load_model().num_parameters()
    assert 0 < largest < total


@pytest.mark.parametrize("name", ["t5-tiny", "t5-small", "t5-base"])
@pytest.mark.parametrize(
    "variant",
    [{}, {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}, {"num_decoder_layers": 1}],
    ids=["as-shipped", "v1.1-gated-untied", "fewer-decoder-layers"],
)
def test_a_t5_counted_from_its_dimensions_matches_the_model_built_on_the_meta_device(name, variant):
    config = AutoConfig.from_pretrained(ASSETS_DIR / name, **variant)
    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(config)
    built = sum(parameter.numel() for parameter in model.parameters())
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())
    assert t5_parameters(config) == count_parameters(config) == (built, largest)


def test_t5_small_from_its_config_file_alone(shared_data_dir):
    total, _ = count_parameters(load_config(shared_data_dir / "t5" / "t5-small.config.json"))
    assert total == T5_SMALL_PARAMETERS


def test_memory_uses_deepspeeds_estimators_and_shrinks_with_sharding(shared_data_dir):
    config = str(shared_data_dir / "t5" / "t5-small.config.json")
    report = estimate(config, nodes=2, gpus_per_node=4, gpu_memory_gb=80)
    total, largest = report["parameters"], report["largest_layer_parameters"]
    profiles = report["profiles"]
    _, zero2 = estimate_zero2_model_states_mem_needs(total, 4, 2, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(total, largest, 4, 2, cpu_offload=False)
    assert profiles["zero2"]["gpu_gb_per_rank"] == round(zero2 / GIB, 3)
    assert profiles["zero3"]["gpu_gb_per_rank"] == round(zero3 / GIB, 3)
    per_rank = [profiles[name]["gpu_gb_per_rank"] for name in ("zero0", "zero1", "zero2", "zero3_offload")]
    assert per_rank == sorted(per_rank, reverse=True)
    assert report["recommended"] == "zero0"


def test_recommends_the_cheapest_profile_that_fits(shared_data_dir):
    config = str(shared_data_dir / "t5" / "t5-small.config.json")
    # t5-small needs about 1.1 GiB of model states per rank unsharded, 0.06 GiB with ZeRO-3 offload.
    assert estimate(config, nodes=1, gpus_per_node=1, gpu_memory_gb=0.2)["recommended"] == "zero3_offload"
    assert estimate(config, nodes=4, gpus_per_node=8, gpu_memory_gb=0.15)["recommended"] == "zero3"
    assert estimate(config, nodes=1, gpus_per_node=1, gpu_memory_gb=0.01)["recommended"] is None


def test_cli_json_is_clean_on_stdout_and_errors_are_one_line():
    result = CliRunner().invoke(
        cli, ["estimate", "--nodes", "2", "--gpus-per-node", "2", "--gpu-memory-gb", "16", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["parameters"] == load_model().num_parameters()
    assert set(report["profiles"]) == {"zero0", "zero1", "zero2", "zero3", "zero3_offload"}
    assert all(isinstance(row["gpu_gb_per_rank"], float) for row in report["profiles"].values())
    assert report["recommended"] == "zero0"

    missing = CliRunner().invoke(cli, ["estimate", "--model", "./no-such-model", "--gpu-memory-gb", "16"])
    assert missing.exit_code == 1
    assert missing.output.count("\n") == 1 and "--model" in missing.output


def test_profile_auto_is_the_recommendation_and_a_named_profile_wins(shared_data_dir):
    config = str(shared_data_dir / "t5" / "t5-small.config.json")
    small_gpus = estimate(config, nodes=4, gpus_per_node=8, gpu_memory_gb=0.15)
    assert choose_profile("auto", small_gpus) == small_gpus["recommended"] == "zero3"
    assert (
        format_estimate(small_gpus, requested="auto").splitlines()[-1]
        == "this run uses: zero3 (profile auto: the recommendation)"
    )
    assert choose_profile("zero1", small_gpus) == "zero1"
    assert (
        format_estimate(small_gpus, requested="zero1").splitlines()[-1]
        == "this run uses: zero1 (named by the profile parameter)"
    )
    assert resolve_profile("auto", config, 4, 8, 0.15) == "zero3"
    with pytest.raises(ProfileError, match="unknown profile 'zero9'"):
        choose_profile("zero9", small_gpus)
    with pytest.raises(ProfileError, match="profile auto: no profile fits .* add nodes or GPUs, or pass --profile"):
        choose_profile("auto", estimate(config, nodes=1, gpus_per_node=1, gpu_memory_gb=0.01))


def test_a_rank_resolves_auto_from_its_world_and_device(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    # Two nodes of two CPU ranks, each with half the host's memory: every profile fits, and on CPUs
    # stage 1 comes first (stage 0 measured a third as fast there).
    assert resolve_profile_here("auto", None) == "zero1"
    assert resolve_profile_here("zero2", "./not-read-for-a-named-profile") == "zero2"


def test_on_cpus_auto_prefers_stage_1_where_it_fits_and_says_why():
    on_gpus = estimate(None, nodes=2, gpus_per_node=1, gpu_memory_gb=16)
    on_cpus = estimate(None, nodes=2, gpus_per_node=1, gpu_memory_gb=16, cpu=True)
    assert (on_gpus["recommended"], on_cpus["recommended"]) == ("zero0", "zero1")
    assert "on CPUs ZeRO-1 ran fastest" in format_estimate(on_cpus) and "CPUs" not in format_estimate(on_gpus)
    # CPU ranks are not described as GPUs anywhere in the table.
    assert "GPU" not in format_estimate(on_cpus) and "2 node(s) x 1 CPU rank(s), 16 GiB" in format_estimate(on_cpus)
    assert "2 node(s) x 1 GPU(s) of 16 GiB" in format_estimate(on_gpus)
    # Where stage 1 does not fit, CPUs get the cheapest profile that does, as GPUs do.
    tight = estimate(
        None,
        nodes=2,
        gpus_per_node=1,
        gpu_memory_gb=on_cpus["profiles"]["zero1"]["gpu_gb_per_rank"] / 0.8 * 0.99,
        cpu=True,
    )
    assert not tight["profiles"]["zero1"]["fits"]
    assert tight["recommended"] == next(name for name, row in tight["profiles"].items() if row["fits"])


def test_the_estimate_command_imports_deepspeed_without_mlflow() -> None:
    """`textsql estimate` in a fresh interpreter: DeepSpeed's estimators run, and MLflow, which its autotuner imports
    when installed (1.1 s of the command's 4.3 s on 2 cores), is not imported."""
    textsql = Path(sys.executable).with_name("textsql")
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(textsql), "estimate", "--gpu-memory-gb", "16", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["recommended"]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "deepspeed.runtime.zero.stage3" in imported and not [name for name in imported if name.startswith("mlflow.")]
