"""textsql launch: DeepSpeed's own launcher over pdsh and ssh, or local; real processes throughout.

The multi-host tests run on two real `local` worker pods (their own sshd on 127.0.0.2 and
127.0.0.3, host keys from the rendezvous) with a small rank program that forms a gloo process
group, so they check the launcher itself in seconds; test_launch_training.py runs the real training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from helpers.launch import BIN, HOSTS, fake_prepared, tagged_processes, textsql_launch
from helpers.paths import PROJECT_DIR

from textsql.arguments import train_argv
from textsql.cli import cli
from textsql.constants import LAUNCH_IDS_NAME
from textsql.errors import LaunchError
from textsql.launching.command import (
    LaunchArguments,
    deepspeed_command,
    local_command,
    rank_environment,
    without_secrets,
)
from textsql.launching.deepspeed_entry import ENTRY_MODULE
from textsql.launching.launch import DEEPSPEED_ENV_NAME, launch
from textsql.rundir.master_state import master_dir
from textsql.sanitize import mask_credentials
from worker.network import free_port

# A rank program: forms the gloo group, all-reduces, reports; fails or lingers when asked.
RANK_MODULE = """
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
"""


def training(tmp_path: Path) -> list[str]:
    """A training command line the launch reads (and checks: a prepared dataset) before anything starts."""
    return train_argv(data_dir=fake_prepared(tmp_path / "data"))


@pytest.fixture
def standin_env(tmp_path: Path) -> dict[str, str]:
    """Rank variables that make the stand-in rank program (--module standin_rank) importable, and
    tag this test's processes (LAUNCH_TEST_TAG) so the test can look for leftovers."""
    directory = tmp_path / "modules"
    directory.mkdir()
    (directory / "standin_rank.py").write_text(RANK_MODULE)
    return {"PYTHONPATH": f"{directory}{os.pathsep}{PROJECT_DIR}", "LAUNCH_TEST_TAG": uuid.uuid4().hex}


MODULE = ("--module", "standin_rank")


# ---- the command and environment DeepSpeed's runner gets ----------------------------------------


def test_command_parses_as_deepspeeds_runner_arguments(tmp_path: Path) -> None:
    from deepspeed.launcher.runner import parse_args

    arguments = LaunchArguments(
        run_dir=tmp_path, train_args=["--run_dir", "out dir", "--resume-from-checkpoint", "auto"], ssh_port=2022
    )
    command = deepspeed_command(arguments, tmp_path / "hostfile", list(HOSTS))
    # DeepSpeed's runner, the `deepspeed` command, run by this interpreter without MLflow (deepspeed_entry).
    assert command[:5] == [sys.executable, "-u", "-m", ENTRY_MODULE, "deepspeed.launcher.runner"]
    parsed = parse_args(command[5:])
    assert (parsed.hostfile, parsed.launcher, parsed.ssh_port) == (str(tmp_path / "hostfile"), "pdsh", 2022)
    assert parsed.master_addr == "127.0.0.2"
    assert parsed.master_port != 29500  # loopback hosts share this machine: a free port, not the fixed default
    remote = parse_args(deepspeed_command(arguments, tmp_path / "hostfile", ["10.0.0.5"])[5:])
    assert (remote.master_addr, remote.master_port) == ("10.0.0.5", 29500)
    assert remote.force_multi, "the runner would start a one-host hostfile's ranks on this machine, not over pdsh"
    assert parsed.module and parsed.no_local_rank and parsed.no_ssh_check
    assert (parsed.user_script, parsed.user_args) == (
        "textsql.training.train",
        ["--run_dir", "out dir", "--resume-from-checkpoint", "auto"],
    )


def test_local_command_is_what_deepspeeds_runner_would_run(tmp_path: Path) -> None:
    """--launcher local skips DeepSpeed's runner: its per-node launcher gets the command line the runner builds."""
    from deepspeed.launcher.launch import parse_args
    from deepspeed.launcher.runner import encode_world_info

    arguments = LaunchArguments(run_dir=tmp_path, launcher="local", master_port=29600, train_args=["--run_dir", "o"])
    command = local_command(arguments, 2)
    assert command[:5] == [sys.executable, "-u", "-m", ENTRY_MODULE, "deepspeed.launcher.launch"]
    sys_argv, sys.argv = sys.argv, ["launch.py", *command[5:]]
    try:
        parsed = parse_args()
    finally:
        sys.argv = sys_argv
    assert parsed.world_info == encode_world_info({"localhost": [0, 1]})
    assert (parsed.master_addr, parsed.master_port, parsed.module, parsed.no_local_rank) == (
        "127.0.0.1",
        29600,
        True,
        True,
    )
    assert (parsed.training_script, parsed.training_script_args) == ("textsql.training.train", ["--run_dir", "o"])


def test_rank_environment_reaches_pdsh_as_exports(tmp_path: Path) -> None:
    """.deepspeed_env lines go through DeepSpeed's own PDSHRunner: PATH keeps $PATH for the host's shell."""
    from deepspeed.launcher.runner import PDSHRunner, parse_args

    env = rank_environment(LaunchArguments(run_dir=tmp_path, env={"EXTRA": "a b"}), list(HOSTS), "0123")
    # Loopback hosts: what each host's sshd set (the interface its agent reported), else lo.
    assert env["GLOO_SOCKET_IFNAME"] == "${GLOO_SOCKET_IFNAME:-lo}"
    assert env["NCCL_SOCKET_IFNAME"] == "${NCCL_SOCKET_IFNAME:-lo}"
    assert env["TEXTSQL_LAUNCH_ID"] == "0123" and env["PYTHONPATH"] == str(PROJECT_DIR)
    assert not any("TOKEN" in key for key in env)
    runner = PDSHRunner(parse_args(["--module", "textsql.training.train"]), "e30=")
    for key, value in env.items():
        runner.add_export(key, value)
    cmd, _, _ = runner.get_cmd({}, {host: [0] for host in HOSTS})
    remote = " ".join(cmd)
    assert f'export PATH="{BIN}:$PATH";' in remote and 'export EXTRA="a b";' in remote
    assert 'export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}";' in remote

    remote_env = rank_environment(LaunchArguments(run_dir=tmp_path), ["10.0.0.5", "10.0.0.6"], "0123")
    assert "GLOO_SOCKET_IFNAME" not in remote_env


def test_a_compile_cache_set_where_the_launch_runs_reaches_the_ranks(tmp_path, monkeypatch) -> None:
    """Carried only when set: unset, each rank keeps it where textsql.training.compiling puts it on its host."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert "TORCHINDUCTOR_CACHE_DIR" not in rank_environment(LaunchArguments(run_dir=tmp_path), list(HOSTS), "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/shared/compile-cache")
    env = rank_environment(LaunchArguments(run_dir=tmp_path), list(HOSTS), "0")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/shared/compile-cache"


def test_credentials_are_kept_from_the_runner_by_name_and_by_value() -> None:
    environ = {
        "HF_TOKEN": "hf_abc",
        "HTTPS_PROXY": "http://alice:hunter2@proxy:3128",
        "PIP_INDEX_URL": "https://bob:pw@index/simple",
        "HTTP_PROXY": "http://proxy:3128",
        "MLFLOW_TRACKING_URI": "https://mlflow.example/a:b@c",
        "PATH": "/usr/bin",
    }
    assert without_secrets(environ) == {
        "HTTP_PROXY": "http://proxy:3128",
        "MLFLOW_TRACKING_URI": "https://mlflow.example/a:b@c",
        "PATH": "/usr/bin",
    }
    line = "export HTTPS_PROXY=http://alice:hunter2@proxy:3128; export B=git+ssh://git:s3cret@host/repo\n"
    assert (
        mask_credentials(line)
        == "export HTTPS_PROXY=http://alice:***@proxy:3128; export B=git+ssh://git:***@host/repo\n"
    )
    assert mask_credentials("https://mlflow.example/a:b@c no user part") == "https://mlflow.example/a:b@c no user part"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--env", "HF_TOKEN=hf_abc"], "looks like a secret"),
        (["--env", "MLFLOW_TRACKING_URI=https://alice:hunter2@mlflow.example"], "holds a password in a URL"),
        (["--env", "NOVALUE"], "pass --env KEY=VALUE"),
        (["--env", "X=$(touch /tmp/x)"], "has a $ that is not a plain $NAME"),
        (["--socket-ifname", "lo;id"], "--socket-ifname 'lo;id' is not a network interface name"),
        (["--master-addr", "10.0.0.1 x"], "--master-addr '10.0.0.1 x' is not an IP address or hostname"),
        (["--ranks", "2"], "--ranks is for --launcher local"),
        (["--", "--run_dir", "$HOME/x"], "characters the hosts' shell would interpret"),
        (["--", "--run_name", "run-%h"], "characters the hosts' shell would interpret"),
        ([], "no dataset given; pass --data-dir"),
        (["--", "--data_dir", "data"], "does not exist; start the workers first"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    result = CliRunner().invoke(cli, ["launch", "--run-dir", str(tmp_path), *options])
    assert result.exit_code == 1
    assert message in result.output and result.output.startswith("Error: ")
    assert "Traceback" not in result.output
    assert not (tmp_path / ".deepspeed_env").exists()


def test_missing_pdsh_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="pdsh is not installed; run `make setup`"):
        launch(LaunchArguments(run_dir=tmp_path, train_args=training(tmp_path)))


def test_unreachable_host_fails_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n")
    config = tmp_path / "config" / "ssh_config"
    config.parent.mkdir()
    config.write_text(f"Host 127.0.0.2\n  Port {free_port('127.0.0.2')}\n  StrictHostKeyChecking yes\n")
    with pytest.raises(LaunchError, match=r"passwordless ssh failed for 127\.0\.0\.2 \(.*Connection refused"):
        launch(LaunchArguments(run_dir=tmp_path, train_args=training(tmp_path), ssh_config=config))
    assert not (tmp_path / "launch.log").exists()


def test_unverified_host_keys_are_refused(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.2 slots=1\n")
    config = tmp_path / "config" / "ssh_config"
    config.parent.mkdir()
    config.write_text("Host *\n  StrictHostKeyChecking no\n")
    with pytest.raises(LaunchError, match="would not verify its host key"):
        launch(LaunchArguments(run_dir=tmp_path, train_args=training(tmp_path), ssh_config=config))


def test_an_ssh_config_a_worker_wrote_in_the_run_dir_runs_nothing_on_the_master(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attack of issue 55 (finding 4): the run directory is the workers' to write (a shared volume, or the store
    guide's NFS for static hosts); an ``ssh_config`` planted there with ``Match exec`` ran its command on the master
    when ``textsql launch --hostfile`` checked its hosts (``ssh -G`` evaluates it)."""
    run_dir, ran = tmp_path / "run", tmp_path / "ran-on-the-master"
    run_dir.mkdir()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=1\n")
    (run_dir / "ssh_config").write_text(
        f'Match exec "touch {ran}"\n  User nobody\nHost *\n  StrictHostKeyChecking yes\n'
    )
    arguments = LaunchArguments(
        run_dir=run_dir, hostfile=hostfile, ssh_port=free_port("127.0.0.2"), train_args=training(tmp_path)
    )
    with pytest.raises(LaunchError, match=r"passwordless ssh failed for 127\.0\.0\.2"):
        launch(arguments)
    assert not ran.exists(), "the worker's Match exec ran on the master"
    assert f"{run_dir / 'ssh_config'} is not read" in caplog.text


# ---- real launches ----------------------------------------------------------------------------


@pytest.mark.slow
def test_failing_rank_ends_every_host_quickly(two_local_workers, standin_env: dict[str, str]) -> None:
    """Rank 1 dies before the process group forms: rank 0 would wait 30 minutes for it; it must not.

    Also: no MLFLOW* variable of the launching environment reaches pdsh's command line or the log (DeepSpeed's
    runner would export them all; they reach the logging rank in a 0600 file, textsql.launching.tracking_env).
    """
    command = textsql_launch(
        two_local_workers.run_dir,
        *("--ssh-config", str(two_local_workers.ssh_config), *MODULE),
        env=standin_env | {"STANDIN_FAIL_RANK": "1"},
    )
    environment = os.environ | {
        "MLFLOW_TRACKING_TOKEN": "do-not-show",
        "MLFLOW_EXPERIMENT_NAME": "launch-test",
        "MLFLOW_TRACKING_URI": "https://alice:hunter2@mlflow.example/",  # DeepSpeed's runner exports MLFLOW*
    }
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    lines, failed_at = [], None
    for line in process.stdout:
        lines.append(line)
        if failed_at is None and "fails on purpose" in line:
            failed_at = time.monotonic()
    assert process.wait(timeout=300) == 1, "".join(lines[-60:])
    output = "".join(lines)
    assert "127.0.0.3: stand-in rank 1 fails on purpose before the process group forms\n" in lines
    assert "ranks on 127.0.0.3 failed with exit code 1" in output
    # The rank's own exit is the cause, not the 255 of the host whose ranks were then ended: retried once, not
    # relaunched as a lost worker until the restarts run out.
    cause = "on 127.0.0.3: stand-in rank 1 fails on purpose before the process group forms (exit code 1)"
    assert f"application error before the first step {cause}" in output and "worker lost" not in output, output
    assert output.count("[supervisor] relaunching") == 1, output
    assert tagged_processes(standin_env["LAUNCH_TEST_TAG"]) == []
    log_path = two_local_workers.run_dir / "launch.log"
    log = log_path.read_text()
    assert "export MLFLOW_" not in output + log and "launch-test" not in output + log
    assert "do-not-show" not in output + log and "hunter2" not in output + log
    assert oct(log_path.stat().st_mode & 0o777) == "0o600"
    # DeepSpeed's runner reads .deepspeed_env again by path, seconds after the check: it lies where no worker writes.
    private = master_dir(two_local_workers.run_dir)
    assert not (two_local_workers.run_dir / DEEPSPEED_ENV_NAME).exists() and (private / DEEPSPEED_ENV_NAME).is_file()
    assert (private / LAUNCH_IDS_NAME).read_text().split(), "each launch's id is on record before it ran"
    worker_logs = list((two_local_workers.run_dir / "workers").rglob("*.log"))
    assert worker_logs and {oct(path.stat().st_mode & 0o777) for path in worker_logs} == {"0o600"}
    print(f"failing rank: textsql launch exited {time.monotonic() - failed_at:.1f} s after the rank failed")


@pytest.mark.slow
def test_sigterm_ends_remote_ranks(two_local_workers, standin_env: dict[str, str]) -> None:
    """Also checks what the ranks got: world, node ranks, an argument with a space, gloo on lo, host prefixes."""
    command = textsql_launch(
        two_local_workers.run_dir,
        *("--ssh-config", str(two_local_workers.ssh_config), *MODULE, "--", "--name", "two words"),
        env=standin_env | {"STANDIN_SLEEP": "600"},
    )
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if sum("stand-in rank" in line for line in seen) == 2:
            break
    for rank, host in enumerate(HOSTS):
        assert f"{host}: stand-in rank {rank}/2 node {rank} sum 2 args ['--name', 'two words'] gloo lo\n" in seen
    launched = tagged_processes(standin_env["LAUNCH_TEST_TAG"])
    assert len(launched) >= 4  # DeepSpeed's launch.py and a rank per host
    # pdsh starts each host's per-node launcher through the entry too: DeepSpeed's program without MLflow.
    command_lines = [_command_line(pid) for pid in launched]
    node_launchers = [words for words in command_lines if "deepspeed.launcher.launch" in words]
    assert len(node_launchers) == 2, node_launchers
    assert all(words[1:5] == ["-u", "-m", ENTRY_MODULE, "deepspeed.launcher.launch"] for words in node_launchers)
    interrupted = time.monotonic()
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=120)
    print(f"SIGTERM: every rank ended and textsql launch exited after {time.monotonic() - interrupted:.1f} s")
    assert process.returncode != 0
    assert "ending every rank of this launch" in rest
    assert tagged_processes(standin_env["LAUNCH_TEST_TAG"]) == []
    log = (two_local_workers.run_dir / "launch.log").read_text()
    assert "127.0.0.3: stand-in rank 1/2" in log


def _command_line(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:  # ended meanwhile
        return []


@pytest.mark.slow
def test_local_launcher_needs_no_ssh(tmp_path: Path, standin_env: dict[str, str]) -> None:
    command = textsql_launch(tmp_path / "run", *MODULE, "--launcher", "local", "--ranks", "2", env=standin_env)
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stand-in rank 0/2 node 0 sum 2" in result.stdout and "stand-in rank 1/2 node 0 sum 2" in result.stdout
    # DeepSpeed's per-node launcher started the ranks itself: no runner, no hostfile.
    assert "runner.py" not in result.stdout and not (tmp_path / "run" / "hostfile.local").exists()
    assert tagged_processes(standin_env["LAUNCH_TEST_TAG"]) == []


def test_a_long_rank_line_is_masked_in_linear_time() -> None:
    """pdsh passes lines of ~128 KiB; masking runs on every rank line, on the thread that also stops a stalled run."""
    for line in ("a" * 128 * 1024, "http" * 32 * 1024, "x://" + "a:" * 64 * 1024, "s://" * 32 * 1024):
        started = time.perf_counter()
        assert mask_credentials(line) == line
        assert time.perf_counter() - started < 0.05, len(line)


def test_a_password_holding_at_signs_is_masked_to_the_authoritys_last_at() -> None:
    assert mask_credentials("see http://alice:p@ss-w0rd@host:5000/api") == "see http://alice:***@host:5000/api"
    assert mask_credentials("s3://key:a/b@bucket") == "s3://key:a/b@bucket"  # the path starts at the first /
    assert without_secrets({"MLFLOW_TRACKING_URI": "http://alice:p@ss@host"}) == {}


def test_a_rank_line_ends_at_its_first_nul_as_pdsh_prints_it() -> None:
    """pdsh prints a line with %s, so nothing after a NUL is shown: no reader sees more of a line than pdsh does."""
    import queue

    from textsql.launching.launch import _read_pipe

    reader, writer = os.pipe()
    os.write(writer, b"127.0.0.3: x\x00127.0.0.2: heartbeat rank 0 step 1 progress 1\n127.0.0.2: ok\n")
    os.close(writer)
    lines: queue.Queue = queue.Queue()
    _read_pipe(os.fdopen(reader, "rb"), False, lines)
    assert [lines.get_nowait() for _ in range(3)] == [(False, "127.0.0.3: x"), (False, "127.0.0.2: ok"), None]
