"""textsql launch: DeepSpeed's own launcher over pdsh and ssh, or local; real processes throughout.

The multi-host tests run two sshd "hosts" on 127.0.0.2 and 127.0.0.3 with a per-test host key and
client key, and a small rank module that forms a gloo process group, so they check the launcher
itself in seconds; test_launch_training.py runs the real training on real worker pods.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from textsql.cli import cli
from textsql.errors import LaunchError
from textsql.launch import LaunchArguments, deepspeed_command, launch, rank_environment

PROJECT_DIR = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOSTS = ("127.0.0.2", "127.0.0.3")

# A rank program: forms the gloo group, all-reduces, reports; fails or lingers when asked.
RANK_MODULE = '''
import os, sys, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
if os.environ.get("STANDIN_FAIL_RANK") == str(rank):
    sys.exit(f"stand-in rank {rank} fails on purpose before the process group forms")
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"stand-in rank {rank}/{dist.get_world_size()} node {os.environ['CROSS_RANK']} sum {total.item():.0f} "
      f"args {sys.argv[1:]} gloo {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
time.sleep(float(os.environ.get("STANDIN_SLEEP", "0")))
dist.destroy_process_group()
'''


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tagged_processes(tag: str) -> list[int]:
    """Pids of processes whose environment holds LAUNCH_TEST_TAG=tag (the ranks of one test)."""
    entry = f"LAUNCH_TEST_TAG={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if entry in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    found.append(int(name))
            except OSError:
                pass
    return found


@pytest.fixture
def rank_module(tmp_path: Path) -> dict[str, str]:
    """--module and --env settings that run the stand-in rank program, tagged for this test."""
    directory = tmp_path / "modules"
    directory.mkdir()
    (directory / "standin_rank.py").write_text(RANK_MODULE)
    return {"module": "standin_rank", "PYTHONPATH": f"{directory}{os.pathsep}{PROJECT_DIR}", "LAUNCH_TEST_TAG": uuid.uuid4().hex}


@pytest.fixture
def ssh_hosts(tmp_path: Path):
    """Two sshd hosts on loopback addresses, with a run dir holding hostfile, known_hosts, ssh_config."""
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("sshd is not installed; run `make setup`")
    keys = tmp_path / "keys"
    run_dir = tmp_path / "run"
    keys.mkdir()
    run_dir.mkdir()
    for name in ("host_key", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", keys / name], check=True)
    (keys / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
    host_key = " ".join((keys / "host_key.pub").read_text().split()[:2])
    port = free_port(HOSTS[0])
    daemons = []
    for host in HOSTS:
        config = keys / f"sshd_{host}"
        config.write_text(
            f"Port {port}\nListenAddress {host}\nHostKey {keys / 'host_key'}\nAuthorizedKeysFile {keys / 'authorized_keys'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\n"
        )
        daemons.append(subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", config], stderr=subprocess.DEVNULL))
    (run_dir / "known_hosts").write_text("".join(f"[{host}]:{port} {host_key}\n" for host in HOSTS))
    (run_dir / "ssh_config").write_text(
        f"Host {' '.join(HOSTS)}\n  Port {port}\n  IdentityFile {keys / 'id_ed25519'}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {run_dir / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n"
    )
    (run_dir / "hostfile").write_text("".join(f"{host} slots=1\n" for host in HOSTS))
    deadline = time.monotonic() + 20
    while any(_closed(host, port) for host in HOSTS):
        assert time.monotonic() < deadline, "sshd did not start"
        time.sleep(0.1)
    yield run_dir
    for daemon in daemons:
        daemon.terminate()
        daemon.wait()


def _closed(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def textsql_launch(run_dir: Path, rank_module: dict[str, str], *options: str, env: tuple[str, ...] = ()) -> list[str]:
    environment = [f"--env={key}={value}" for key, value in rank_module.items() if key != "module"]
    return [
        str(BIN / "textsql"), "launch", "--run-dir", str(run_dir), "--master-port", str(free_port(HOSTS[0])),
        "--module", rank_module["module"], *environment, *[f"--env={entry}" for entry in env], *options,
    ]


# ---- the command and environment DeepSpeed's runner gets ----------------------------------------

def test_command_parses_as_deepspeeds_runner_arguments(tmp_path: Path) -> None:
    from deepspeed.launcher.runner import parse_args

    arguments = LaunchArguments(run_dir=tmp_path, train_args=["--output_dir", "out dir", "--resume", "auto"], ssh_port=2022)
    command = deepspeed_command(arguments, tmp_path / "hostfile", list(HOSTS))
    assert command[0] == str(BIN / "deepspeed")
    parsed = parse_args(command[1:])
    assert (parsed.hostfile, parsed.launcher, parsed.ssh_port) == (str(tmp_path / "hostfile"), "pdsh", 2022)
    assert (parsed.master_addr, parsed.master_port) == ("127.0.0.2", 29500)
    assert parsed.module and parsed.no_local_rank and parsed.no_ssh_check
    assert (parsed.user_script, parsed.user_args) == ("textsql.train", ["--output_dir", "out dir", "--resume", "auto"])


def test_rank_environment_reaches_pdsh_as_exports(tmp_path: Path) -> None:
    """.deepspeed_env lines go through DeepSpeed's own PDSHRunner: PATH keeps $PATH for the host's shell."""
    from deepspeed.launcher.runner import PDSHRunner, parse_args

    env = rank_environment(LaunchArguments(run_dir=tmp_path, env={"EXTRA": "a b"}), list(HOSTS), "0123")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["TEXTSQL_LAUNCH_ID"] == "0123" and env["PYTHONPATH"] == str(PROJECT_DIR)
    assert not any("TOKEN" in key for key in env)
    runner = PDSHRunner(parse_args(["--module", "textsql.train"]), "e30=")
    for key, value in env.items():
        runner.add_export(key, value)
    cmd, _, _ = runner.get_cmd({}, {host: [0] for host in HOSTS})
    remote = " ".join(cmd)
    assert f'export PATH="{BIN}:$PATH";' in remote and 'export EXTRA="a b";' in remote
    assert "export GLOO_SOCKET_IFNAME=lo;" in remote

    remote_env = rank_environment(LaunchArguments(run_dir=tmp_path), ["10.0.0.5", "10.0.0.6"], "0123")
    assert "GLOO_SOCKET_IFNAME" not in remote_env


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--env", "HF_TOKEN=hf_abc"], "looks like a secret"),
        (["--env", "NOVALUE"], "pass --env KEY=VALUE"),
        (["--ranks", "2"], "--ranks is for --launcher local"),
        (["--", "--output_dir", "$HOME/x"], "characters the hosts' shell would interpret"),
        (["--", "--run_name", "run-%h"], "characters the hosts' shell would interpret"),
        ([], "does not exist; start the workers first"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(tmp_path: Path, options: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["launch", "--run-dir", str(tmp_path), *options])
    assert result.exit_code == 1
    assert message in result.output and result.output.startswith("Error: ")
    assert "Traceback" not in result.output
    assert not (tmp_path / ".deepspeed_env").exists()


def test_missing_pdsh_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="pdsh is not installed; run `make setup`"):
        launch(LaunchArguments(run_dir=tmp_path))


def test_unreachable_host_fails_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n")
    (tmp_path / "ssh_config").write_text(f"Host 127.0.0.2\n  Port {free_port('127.0.0.2')}\n  StrictHostKeyChecking yes\n")
    with pytest.raises(LaunchError, match=r"passwordless ssh failed for 127\.0\.0\.2 \(.*Connection refused"):
        launch(LaunchArguments(run_dir=tmp_path))
    assert not (tmp_path / "launch.log").exists()


def test_unverified_host_keys_are_refused(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n")
    (tmp_path / "ssh_config").write_text("Host *\n  StrictHostKeyChecking no\n")
    with pytest.raises(LaunchError, match="would not verify its host key"):
        launch(LaunchArguments(run_dir=tmp_path))


# ---- real launches ----------------------------------------------------------------------------

@pytest.mark.slow
def test_two_hosts_over_pdsh_with_verified_host_keys(ssh_hosts: Path, rank_module: dict[str, str]) -> None:
    result = subprocess.run(
        textsql_launch(ssh_hosts, rank_module, "--", "--name", "two words"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank, host in enumerate(HOSTS):
        assert f"{host}: stand-in rank {rank}/2 node {rank} sum 2 args ['--name', 'two words'] gloo lo" in result.stdout
    log = (ssh_hosts / "launch.log").read_text()
    assert "127.0.0.3: stand-in rank 1/2" in log and "# exit code 0" in log
    assert "StrictHostKeyChecking no" not in log + result.stderr


@pytest.mark.slow
def test_failing_rank_ends_every_host_quickly(ssh_hosts: Path, rank_module: dict[str, str]) -> None:
    """Rank 1 dies before the process group forms: rank 0 would wait 30 minutes for it; it must not."""
    started = time.monotonic()
    result = subprocess.run(
        textsql_launch(ssh_hosts, rank_module, env=("STANDIN_FAIL_RANK=1",)), capture_output=True, text=True, timeout=300
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "127.0.0.3: stand-in rank 1 fails on purpose before the process group forms" in result.stdout
    assert "ranks on 127.0.0.3 failed with exit code 1" in result.stderr
    assert tagged_processes(rank_module["LAUNCH_TEST_TAG"]) == []
    print(f"failing rank: textsql launch exited {elapsed:.1f} s after it started")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_ends_remote_ranks(ssh_hosts: Path, rank_module: dict[str, str], sig: signal.Signals) -> None:
    process = subprocess.Popen(
        textsql_launch(ssh_hosts, rank_module, env=("STANDIN_SLEEP=600",)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen = []
    for line in process.stdout:
        seen.append(line)
        if sum("stand-in rank" in line for line in seen) == 2:
            break
    assert len(tagged_processes(rank_module["LAUNCH_TEST_TAG"])) >= 4, "".join(seen)  # launch.py + rank per host
    interrupted = time.monotonic()
    process.send_signal(sig)
    rest, _ = process.communicate(timeout=120)
    print(f"{sig.name}: every rank ended and textsql launch exited after {time.monotonic() - interrupted:.1f} s")
    assert process.returncode != 0
    assert "ending every rank of this launch" in rest
    assert tagged_processes(rank_module["LAUNCH_TEST_TAG"]) == []


@pytest.mark.slow
def test_local_launcher_needs_no_ssh(tmp_path: Path, rank_module: dict[str, str]) -> None:
    result = subprocess.run(
        textsql_launch(tmp_path / "run", rank_module, "--launcher", "local", "--ranks", "2"),
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stand-in rank 0/2 node 0 sum 2" in result.stdout and "stand-in rank 1/2 node 0 sum 2" in result.stdout
    assert (tmp_path / "run" / "hostfile.local").read_text() == "localhost slots=2\n"
