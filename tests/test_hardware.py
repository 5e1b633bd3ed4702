"""Defaults chosen from device facts (passed in, so every case runs on a CPU), and the teardown."""

import pytest
import torch

from textsql.planning.device_defaults import DeviceFacts, device_facts, fast_defaults
from textsql.planning.train_args import parse_command_line
from textsql.training.hardware import share_cpu_threads, teardown_distributed, token_budget_record
from worker.network import free_port

H100 = DeviceFacts(cuda=True, compute_capability=(9, 0), memory_gib=79.2, gpus=1, cpu_cores=16)
V100 = DeviceFacts(cuda=True, compute_capability=(7, 0), memory_gib=15.8, gpus=8, cpu_cores=16)
CPU = DeviceFacts(cuda=False, cpu_cores=2)


def test_a_cpu_gets_fused_adamw_and_no_pinned_memory():
    assert fast_defaults(CPU) == {"optim": "adamw_torch_fused", "dataloader_pin_memory": False}


def test_a_cuda_gpu_gets_fused_adamw_pinned_workers_and_no_per_step_sync():
    defaults = fast_defaults(H100)
    assert defaults["optim"] == "adamw_torch_fused"
    assert defaults["dataloader_pin_memory"] and defaults["dataloader_persistent_workers"]
    assert defaults["dataloader_num_workers"] == 4
    assert defaults["logging_nan_inf_filter"] is False
    # Eager: on one H200, compiling t5-small paid off only after thousands of steps (bench/gpu_quick.json).
    assert "torch_compile" not in defaults and "torch_compile" not in fast_defaults(CPU)


def test_tf32_only_from_ampere_on():
    assert fast_defaults(H100)["tf32"] is True
    assert "tf32" not in fast_defaults(V100)


def test_loader_workers_share_the_cores_among_the_ranks():
    assert fast_defaults(V100)["dataloader_num_workers"] == 1


@pytest.fixture
def torch_threads():
    """Four torch threads for the test, torch's own count restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_cpu_ranks_of_one_node_share_its_threads(monkeypatch, torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert share_cpu_threads(2) == 2
    assert torch.get_num_threads() == 2
    assert share_cpu_threads(8) == 1  # never none


def test_an_explicit_omp_num_threads_is_left_alone(monkeypatch, torch_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert share_cpu_threads(2) is None
    assert torch.get_num_threads() == 4


def test_the_token_budget_grows_with_gpu_memory_in_multiples_of_8():
    small, large = fast_defaults(V100)["max_tokens_per_batch"], fast_defaults(H100)["max_tokens_per_batch"]
    assert small < large and small % 8 == 0 and large % 8 == 0


def test_this_machine_is_described_and_its_defaults_reach_the_trainer():
    facts = device_facts()
    assert facts.cuda == torch.cuda.is_available() and facts.cpu_cores >= 1
    *_, training = parse_command_line(["--data_dir", "data", "--run_dir", "out"])
    assert training["optim"] == fast_defaults(facts)["optim"]
    *_, training = parse_command_line(["--data_dir", "data", "--run_dir", "out", "--optim", "sgd"])
    assert training["optim"] == "sgd"


def test_the_token_budget_flag_reaches_the_data_arguments():
    _, data, *_ = parse_command_line(["--data_dir", "data", "--run_dir", "out", "--max_tokens_per_batch", "4096"])
    assert data.max_tokens_per_batch == 4096


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the record holds its memory figures")
def test_run_json_keeps_the_token_budget_and_no_gpu_figures_on_a_cpu():
    assert token_budget_record(2048) == {
        "max_tokens_per_batch": 2048,
        "gpu_memory_gib": None,
        "cuda_max_memory_allocated_gib": None,
    }


def test_teardown_destroys_the_group_and_forgets_accelerates_state(monkeypatch):
    from accelerate import PartialState

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    PartialState()
    teardown_distributed()
    assert not torch.distributed.is_initialized()
    assert not PartialState._shared_state
    teardown_distributed()  # nothing to tear down: no error


@pytest.mark.gpu
def test_on_this_gpu_the_defaults_are_the_fast_ones():
    assert fast_defaults(device_facts())["optim"] == "adamw_torch_fused"
