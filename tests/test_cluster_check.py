"""The cluster check: what each worker reports about itself (worker/inventory.py), and the master refusing a
cluster that cannot train before pdsh starts (textsql/launching/cluster_check.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.launch import fake_prepared

from textsql.cli import cli
from textsql.json_files import write_json
from textsql.launching.cluster_check import (
    CHECKPOINTS_KEPT,
    ClusterError,
    check_cluster,
    checkpoint_size,
    cluster_problems,
)
from textsql.launching.command import LaunchArguments
from textsql.launching.supervisor import supervise
from textsql.training.collective import figures
from worker import constants as c
from worker.cluster import start_workers
from worker.inventory import InvalidInventory, Inventory, collect, interface_of, overrides_for
from worker.registration import InvalidRegistration, Registration

VENV_BIN = str(Path(sys.executable).parent)
MASTER = Inventory(python="3.11.7", torch="2.13.0+cpu", deepspeed="0.19.8", transformers="5.23.0", textsql="0.1.0")


def worker(pod: str, address: str, slots: int = 1, **inventory) -> Registration:
    return Registration(address, slots, "host", pod, inventory=replace(MASTER, **inventory))


def test_inventory_round_trips_and_rejects_what_no_host_reports():
    inventory = collect("127.0.0.2", Path.cwd())
    assert Inventory.from_dict(inventory.to_dict()) == inventory
    assert inventory.interface == "lo" and inventory.python and inventory.free_disk_bytes > 0
    bad = [
        ({**inventory.to_dict(), "shell": "rm"}, "unknown inventory field 'shell'"),
        ({**inventory.to_dict(), "torch": "2.0 ; rm -rf"}, "'torch' has an unexpected value"),
        ({**inventory.to_dict(), "accelerators": True}, "'accelerators' must be an integer"),
        ({**inventory.to_dict(), "accelerators": 10**6}, "'accelerators' must be an integer"),
        ({**inventory.to_dict(), "interface": "x" * 16}, "'interface' has an unexpected value"),
        ({"torch": "2.0.0"}, "inventory lacks 'python'"),
    ]
    for data, message in bad:
        with pytest.raises(InvalidInventory, match=message):
            Inventory.from_dict(data)
    registration = {"address": "127.0.0.2", "slots": 1, "hostname": "h", "inventory": bad[0][0]}
    with pytest.raises(InvalidRegistration, match="unknown inventory field 'shell'"):
        Registration.from_dict(registration)


def test_collecting_imports_none_of_the_training_stack():
    script = (
        "import json, sys, pathlib\n"
        "from worker.inventory import collect\n"
        "inventory = collect('127.0.0.1', pathlib.Path.cwd())\n"
        "print(json.dumps([inventory.torch, [name for name in ('torch', 'deepspeed', 'transformers') if name in sys.modules]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    version, imported = json.loads(done.stdout)
    assert version and imported == []


def test_interface_and_overrides():
    assert interface_of("127.0.0.3") == "lo"
    text = json.dumps({"*": {"torch": "1.0"}, "local-1": {"torch": "2.0.0"}})
    assert overrides_for("local-1", text) == {"torch": "2.0.0"}
    assert overrides_for("local-0", text) == {"torch": "1.0"}
    assert overrides_for("local-0", None) == {}
    with pytest.raises(InvalidInventory, match="JSON object of pod"):
        overrides_for("local-0", "[1]")


def test_versions_that_differ_are_named_by_pod_and_both_versions():
    workers = [worker("local-0", "127.0.0.2"), worker("local-1", "127.0.0.3", torch="2.0.0", python="3.12.1")]
    problems = cluster_problems(workers, MASTER)
    assert problems == [
        (
            "pod local-1 (127.0.0.3) has python 3.12.1, the master has 3.11.7: install Python 3.11.7 there "
            "(the same image or requirements.txt on every host)"
        ),
        (
            "pod local-1 (127.0.0.3) has torch 2.0.0, the master has 2.13.0+cpu: install torch==2.13.0+cpu there "
            "(the same image or requirements.txt on every host)"
        ),
    ]


def test_a_gpu_build_on_workers_and_a_cpu_build_on_the_master_agree_but_cuda_must_match_across_workers():
    workers = [
        worker("gpu-0", "10.0.0.2", torch="2.13.0+cu128", cuda="12.8"),
        worker("gpu-1", "10.0.0.3", torch="2.13.0+cu126", cuda="12.6"),
    ]
    assert cluster_problems(workers, MASTER) == [
        (
            "pod gpu-1 (10.0.0.3) has cuda 12.6, pod gpu-0 has 12.8: install a torch built for CUDA 12.8 there "
            "(the same image or requirements.txt on every host)"
        )
    ]


def test_slots_must_match_the_gpus_and_disk_must_hold_two_checkpoints():
    size = checkpoint_size("default")
    workers = [
        worker("gpu-0", "10.0.0.2", slots=8, accelerators=8, accelerator_model="NVIDIA H100"),
        worker("gpu-1", "10.0.0.3", slots=1, accelerators=8, accelerator_model="NVIDIA H100"),
        worker("cpu-0", "10.0.0.4", free_disk_bytes=CHECKPOINTS_KEPT * size - 1),
        worker("cpu-1", "10.0.0.5", free_disk_bytes=CHECKPOINTS_KEPT * size),
    ]
    problems = cluster_problems(workers, MASTER, checkpoint_bytes=size)
    assert len(problems) == 2
    assert problems[0].startswith("pod gpu-1 (10.0.0.3) registered 1 slot(s) but has 8 NVIDIA H100(s): set worker_gpus")
    assert problems[1].startswith("pod cpu-0 (10.0.0.4) has ") and "2 checkpoints need" in problems[1]


def test_hosts_that_report_nothing_are_not_judged():
    attached = Registration("10.0.0.2", 8, "gpu1", "gpu1")
    assert cluster_problems([attached], MASTER) == []


def test_preflight_shows_a_runs_hosts_bandwidth_and_problems_one_line_each(tmp_path):
    workers = [
        worker("local-0", "127.0.0.2", interface="lo"),
        worker(
            "local-1", "127.0.0.3", torch="2.0.0", interface="eth1", accelerators=2, accelerator_model="NVIDIA A10G"
        ),
    ]
    with pytest.raises(ClusterError) as refused:
        check_cluster(workers, tmp_path, model="default")
    # The ranks on 127.0.0.3 joined each all-reduce 2 s after the others.
    timings = [[(0.0, 2.01), (2.0, 0.01)]] * 3
    write_json(tmp_path / "collective.json", figures(["127.0.0.2", "127.0.0.3"], timings, "gloo"))
    result = CliRunner().invoke(cli, ["preflight", "--require", "prepare", "--run-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("host ") :].splitlines()
    assert table[0].split() == [
        "host", "pod", "python", "torch", "deepspeed", "transformers", "accelerators", "interface", "all-reduce", "free", "disk",
    ]  # fmt: skip
    assert table[1].split()[:2] == ["master", "-"] and table[1].split()[-4:-2] == ["-", "-"]
    assert table[2].split() == [
        "127.0.0.2", "local-0", "3.11.7", "2.13.0+cpu", "0.19.8", "5.23.0", "none", "(CPU)", "lo", "0.839", "GB/s", "?",
    ]  # fmt: skip
    assert table[3].split() == [
        "127.0.0.3", "local-1", "3.11.7", "2.0.0", "0.19.8", "5.23.0", "2", "x", "NVIDIA", "A10G", "eth1", "0.839", "GB/s", "slow", "?",
    ]  # fmt: skip
    # The check's problems, the same lines it refused the cluster with.
    assert table[4:] == [f"problem: {line}" for line in str(refused.value).splitlines()[1:]] and len(table) == 6


@pytest.mark.slow
def test_two_local_pods_with_another_torch_and_wrong_slots_are_refused_before_pdsh(tmp_path):
    run_dir = tmp_path / "run"
    overrides = {
        "local-1": {"torch": "2.0.0"},
        "local-0": {"accelerators": 2, "accelerator_model": "NVIDIA A10G"},
    }
    env = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}", c.ENV_INVENTORY_OVERRIDES: json.dumps(overrides)}
    with start_workers("local", 2, run_dir, timeout=60, env=env) as cluster, pytest.raises(ClusterError) as refused:
        supervise(
            LaunchArguments(run_dir=cluster.run_dir, train_args=["--data_dir", str(fake_prepared(tmp_path / "data"))]),
            cluster,
        )
    lines = str(refused.value).splitlines()
    master_torch = collect(None, run_dir).torch
    assert lines[0] == "this cluster cannot train (2 problem(s)), nothing was launched:"
    assert lines[1].startswith(f"pod local-1 (127.0.0.3) has torch 2.0.0, the master has {master_torch}: install")
    assert lines[2].startswith("pod local-0 (127.0.0.2) registered 1 slot(s) but has 2 NVIDIA A10G(s)")
    assert not (run_dir / "launch.log").exists(), "pdsh never started"


# A rank program that only says which interface NCCL and gloo would use on its host.
IFNAME_PROBE = """
import os
print(f"ifname probe rank {os.environ['RANK']}: NCCL {os.environ.get('NCCL_SOCKET_IFNAME')} GLOO {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
"""


@pytest.mark.slow
def test_each_rank_sees_the_interface_its_host_reported_unless_socket_ifname_overrides(tmp_path):
    run_dir, modules = tmp_path / "run", tmp_path / "modules"
    modules.mkdir()
    (modules / "ifname_probe.py").write_text(IFNAME_PROBE)
    # ifb1 stands for a pod's second network: the probe never opens a socket on it.
    overrides = {"local-1": {"interface": "ifb1"}}
    env = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}", c.ENV_INVENTORY_OVERRIDES: json.dumps(overrides)}
    rank_env = {"PYTHONPATH": f"{modules}{os.pathsep}{Path(__file__).resolve().parent.parent}"}
    with start_workers("local", 2, run_dir, timeout=60, env=env) as cluster:
        seen = {}
        for socket_ifname in (None, "lo"):
            stream = io.StringIO()
            arguments = LaunchArguments(
                run_dir=run_dir, module="ifname_probe", env=rank_env, socket_ifname=socket_ifname
            )
            assert supervise(arguments, cluster, max_restarts=0, stream=stream) == 0, stream.getvalue()[-3000:]
            seen[socket_ifname] = sorted(line for line in stream.getvalue().splitlines() if "ifname probe" in line)
            recorded = json.loads((run_dir / "cluster.json").read_text())
            assert [host["socket_ifname"] for host in recorded["hosts"]] == [
                socket_ifname or "lo",
                socket_ifname or "ifb1",
            ]
    assert seen[None] == [
        "127.0.0.2: ifname probe rank 0: NCCL lo GLOO lo",
        "127.0.0.3: ifname probe rank 1: NCCL ifb1 GLOO ifb1",
    ]
    assert seen["lo"] == [
        "127.0.0.2: ifname probe rank 0: NCCL lo GLOO lo",
        "127.0.0.3: ifname probe rank 1: NCCL lo GLOO lo",
    ]
