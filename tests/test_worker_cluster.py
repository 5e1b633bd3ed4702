"""Real local workers: agent processes with their own sshd, verified ssh, pdsh, and clean shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.rendezvous import serve_command

from worker import constants as c
from worker.backends.local import LocalBackend
from worker.cluster import start_workers
from worker.errors import RendezvousError
from worker.network import free_port

pytestmark = pytest.mark.slow
VENV_BIN = str(Path(sys.executable).parent)


def agent_pids(run_dir: Path) -> list[int]:
    """Agent and sshd processes that belong to this run (found by their config/log paths)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmdline = " ".join(process.info["cmdline"] or [])
            environ = process.info["environ"] or {}
        except (psutil.Error, TypeError):
            continue
        if str(run_dir) in cmdline or str(run_dir) in environ.get(c.ENV_WORKER_DIR, ""):
            found.append(process.info["pid"])
    return found


def wait_gone(run_dir: Path, within: float = 15) -> list[int]:
    deadline = time.monotonic() + within
    while (left := agent_pids(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_local_workers_answer_ssh_with_verified_host_keys(tmp_path):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    with start_workers("local", 2, run_dir, timeout=60, env=env) as cluster:
        assert cluster.hosts == ["127.0.0.2", "127.0.0.3"] and cluster.master_addr == "127.0.0.2"
        assert cluster.hostfile.read_text() == "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"
        keys = [
            (run_dir / "workers" / f"local-{i}" / "sshd" / "ssh_host_ed25519_key.pub").read_text().split()[:2]
            for i in range(2)
        ]
        assert cluster.known_hosts.read_text() == "".join(
            f"[127.0.0.{i + 2}]:{cluster.ssh_port} {' '.join(keys[i])}\n" for i in range(2)
        )
        assert oct((run_dir / c.TOKEN_NAME).stat().st_mode & 0o777) == "0o600"
        token = (run_dir / c.TOKEN_NAME).read_text().strip()

        for host in cluster.hosts:
            result = cluster.ssh(
                host, f"{sys.executable} -c 'import sys, worker; print(sys.prefix)'; echo \"$PATH\"; env"
            )
            assert result.returncode == 0, result.stderr
            prefix, path = result.stdout.splitlines()[:2]
            assert prefix == sys.prefix and VENV_BIN in path.split(":")
            assert token not in result.stdout and c.ENV_TOKEN_FILE not in result.stdout

        # pdsh, as DeepSpeed's launcher runs it, over the same ssh_config.
        pdsh = subprocess.run(
            ["pdsh", "-S", "-w", ",".join(cluster.hosts), "cd /tmp; echo ready"],
            check=False,
            env={**os.environ, **cluster.pdsh_env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert pdsh.returncode == 0, pdsh.stderr
        assert sorted(pdsh.stdout.splitlines()) == ["127.0.0.2: ready", "127.0.0.3: ready"]

        # A known_hosts holding another key for the worker: ssh refuses, it never asks.
        forged = tmp_path / "forged_known_hosts"
        forged.write_text(cluster.known_hosts.read_text().replace(keys[0][1], keys[1][1]))
        config = tmp_path / "forged_config"
        config.write_text(cluster.ssh_config.read_text().replace(str(cluster.known_hosts), str(forged)))
        refused = subprocess.run(
            ["ssh", "-F", str(config), "127.0.0.2", "true"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert refused.returncode == 255 and "host key" in refused.stderr.lower()

        # Another client key is not authorized.
        other = tmp_path / "other_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
        config.write_text(cluster.ssh_config.read_text().replace(str(cluster.identity_file), str(other)))
        denied = subprocess.run(
            ["ssh", "-F", str(config), "127.0.0.2", "true"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert denied.returncode == 255 and "permission denied" in denied.stderr.lower()
        port = cluster.ssh_port
    assert wait_gone(run_dir) == []
    logs = (run_dir / "workers" / "local-0.log").read_text()
    assert "released by the master" in logs and "sshd on 127.0.0.2" in logs and token not in logs
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=2)


class _OneLostWorker(LocalBackend):
    """Launches the workers, but the last one looks for the master at a closed port (a pod that never comes)."""

    def launch(self, count, resources, env):
        handles = super().launch(count - 1, resources, env)
        unreachable = dict(env, **{c.ENV_RENDEZVOUS: "127.0.0.1:9", c.ENV_DEADLINE: "600"})
        return handles + super().launch(1, resources, unreachable)


def test_missing_worker_is_named_and_everything_is_stopped(tmp_path):
    run_dir = tmp_path / "run"
    # 8 s: time for the other worker to start Python and its sshd and register on a loaded machine.
    with (
        pytest.raises(RendezvousError, match=r"^only 1 of 2 workers registered within 8s; missing: local-1;"),
        start_workers(_OneLostWorker(), 2, run_dir, timeout=8),
    ):
        pytest.fail("the block must not run without every worker")
    assert not (run_dir / "hostfile").exists() and not (run_dir / "ssh_config").exists()
    assert wait_gone(run_dir) == []


def test_worker_that_dies_fails_the_start_at_once(tmp_path):
    # The error names the dead worker's exit, not the 120 s registration timeout.
    with (
        pytest.raises(RendezvousError, match=r"worker local-0 exited with code 1: .*bad number"),
        start_workers("local", 1, tmp_path / "run", timeout=120, env={c.ENV_SLOTS: "many"}),
    ):
        pass
    assert not (tmp_path / "run" / "hostfile").exists()


def test_keyboard_interrupt_inside_the_block_stops_workers(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt), start_workers("local", 1, run_dir, timeout=60, sshd=False):
        assert agent_pids(run_dir)
        raise KeyboardInterrupt
    assert wait_gone(run_dir) == []


def test_agent_exits_cleanly_on_sigterm_and_when_the_master_dies(tmp_path):
    token_file, hostfile = tmp_path / "token", tmp_path / "hostfile"
    port = free_port()  # any free port for the master
    serve = subprocess.Popen(
        serve_command(2, port, token_file, hostfile, "--hold"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        env = dict(
            os.environ,
            **{
                c.ENV_RENDEZVOUS: f"127.0.0.1:{port}",
                c.ENV_TOKEN_FILE: str(token_file),
                c.ENV_SSHD: "0",
                c.ENV_SLOTS: "1",
            },
        )
        deadline = time.monotonic() + 60
        while not token_file.exists() and serve.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert token_file.exists(), serve.stdout.read() if serve.poll() is not None else "serve made no token file"
        agents = [
            subprocess.Popen(
                [sys.executable, "-m", "worker.agent"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(env, **{c.ENV_ADDRESS: f"127.0.0.{i + 2}", c.ENV_POD: f"a{i}"}),
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 60
        while not hostfile.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hostfile.read_text() == "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"
        agents[0].send_signal(signal.SIGTERM)
        assert agents[0].wait(timeout=30) == 0
        serve.kill()  # the master vanishes without releasing anyone
        assert agents[1].wait(timeout=60) == 0
        assert "the master is gone" in agents[1].stdout.read()
        assert "stopping on signal" in agents[0].stdout.read()
    finally:
        serve.kill()
        serve.wait()


def test_open_workers_for_notebooks_stops_on_request(tmp_path):
    from worker.cluster import open_workers

    run_dir = tmp_path / "run"
    cluster = open_workers("local", 1, run_dir, timeout=60, sshd=False)
    assert cluster.hostfile.read_text() == "127.0.0.2 slots=1\n" and agent_pids(run_dir)
    cluster.stop()
    assert wait_gone(run_dir) == []
    cluster.stop()  # twice is harmless


def test_a_stopped_workers_ssh_sessions_end_with_it(tmp_path):
    """What a pod's end does to what runs in it, a local worker does too: a launcher and its ranks started over ssh
    end when the agent stops, whether the master released it or went away. Before, sshd's listener stopped and its
    sessions' processes went on (a killed notebook kernel left a local demo training)."""
    run_dir = tmp_path / "run"
    marker = f"sleep {9000 + os.getpid() % 1000}"  # this test's own command line among the machine's processes
    with start_workers("local", 1, run_dir, timeout=60) as cluster:
        session = subprocess.Popen(
            ["ssh", "-F", str(cluster.ssh_config), "127.0.0.2", f"bash -c '{marker} & wait'"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not (running := commands_like(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running, "the session's command never started"
    deadline = time.monotonic() + 15
    while commands_like(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = commands_like(marker)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert leftovers == [] and session.wait(timeout=15) is not None
    assert wait_gone(run_dir) == []  # the ssh client's command line names the run's ssh_config too


def commands_like(command: str) -> list[int]:
    """The live processes whose command line is ``command``."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        if " ".join(process.info["cmdline"] or []) == command and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process.info["pid"])
    return found


def test_sigterm_flood_still_stops_sshd_cleanly(tmp_path):
    # A kubelet or an impatient user may signal again while the agent is already shutting down:
    # the later signals must not cut sshd's stop short (no orphan sshd, its stop logged).
    run_dir = tmp_path / "run"
    with start_workers("local", 1, run_dir, timeout=60) as cluster:
        port = cluster.ssh_port
        agent = next(
            psutil.Process(pid)
            for pid in agent_pids(run_dir)
            if "worker.agent" in " ".join(psutil.Process(pid).cmdline())
        )
        deadline = time.monotonic() + 30
        while agent.is_running() and agent.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            agent.send_signal(signal.SIGTERM)
            time.sleep(0.002)
    assert wait_gone(run_dir) == []
    logs = (run_dir / "workers" / "local-0.log").read_text()
    assert "stopping on signal" in logs and f"sshd on 127.0.0.2:{port} stopped" in logs


def test_a_local_agent_killed_hard_leaves_nothing_in_the_machines_temporary_space(tmp_path):
    """A local pod's temporary files (its heartbeat socket's directory) are the backend's to remove: an agent killed
    with SIGKILL cannot, and its /tmp is this machine's. Before, every such agent left a textsql-beats-* behind."""
    run_dir = tmp_path / "run"
    with start_workers("local", 1, run_dir, timeout=60, sshd=False) as cluster:
        (agent,) = [pid for pid in agent_pids(run_dir) if "worker.agent" in " ".join(psutil.Process(pid).cmdline())]
        tmpdir = Path(psutil.Process(agent).environ()["TMPDIR"])
        assert tmpdir.is_dir() and tmpdir.name.startswith(f"textsql-{cluster.workers[0].pod}-")
        deadline = time.monotonic() + 30
        while not list(tmpdir.glob("textsql-beats-*/beats.sock")):
            assert time.monotonic() < deadline, "the agent's heartbeat socket is not in its own TMPDIR"
            time.sleep(0.05)
        os.kill(agent, signal.SIGKILL)
        assert wait_gone(run_dir) == []
    assert not tmpdir.exists()
