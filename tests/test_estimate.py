"""textsql estimate: parameters from the config alone, DeepSpeed's estimators, the cheapest profile that fits."""
import json

from click.testing import CliRunner
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from textsql.cli import cli
from textsql.estimate import GIB, count_parameters, estimate
from textsql.model import load_config, load_model

T5_SMALL_PARAMETERS = 60_506_624  # t5-small as published (tied embeddings counted once)


def test_parameters_come_from_the_config_and_match_the_built_model():
    total, largest = count_parameters(load_config(None))
    assert total == load_model().num_parameters()
    assert 0 < largest < total


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
    result = CliRunner().invoke(cli, ["estimate", "--nodes", "2", "--gpus-per-node", "2", "--gpu-memory-gb", "16", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["parameters"] == load_model().num_parameters()
    assert set(report["profiles"]) == {"zero0", "zero1", "zero2", "zero3", "zero3_offload"}
    assert all(isinstance(row["gpu_gb_per_rank"], float) for row in report["profiles"].values())
    assert report["recommended"] == "zero0"

    missing = CliRunner().invoke(cli, ["estimate", "--model", "./no-such-model", "--gpu-memory-gb", "16"])
    assert missing.exit_code == 1
    assert missing.output.count("\n") == 1 and "--model" in missing.output
