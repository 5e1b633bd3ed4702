"""A real Slurm cluster on this machine for the tests: munged, slurmctld and two slurmd (``node1`` on 127.0.0.2,
``node2`` on 127.0.0.3), all run as root from Debian's slurm-wlm and munge (scripts/setup-system.sh --dev).

Everything is its own: a directory under /tmp (short: munge's socket path has a length limit) with the
configuration (``SLURM_CONF``), a fresh munge key and socket (named in ``AuthInfo``, so the clients find it
without anything system-wide), free ports for the controller and each slurmd, and spool, state, pid and log
files; two test runs at once do not meet. :meth:`SlurmCluster.start` returns once both nodes are idle.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from textsql.launching.ranks import marked_processes
from worker.network import free_port

NODES = {"node1": "127.0.0.2", "node2": "127.0.0.3"}
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch")
# Seconds for the daemons to come up and both nodes to be idle (about 1 s here).
READY_S = 60.0
# How long each group of daemons may take to exit on SIGTERM (they took about 2 s).
STOP_S = 10.0


def missing_tools() -> list[str]:
    """The Slurm and munge programs absent here (scripts/setup-system.sh --dev installs them)."""
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def slurm_conf(directory: Path, ports: dict[str, int], socket_path: Path) -> str:
    """The cluster's slurm.conf: one partition ``debug`` of both nodes; jobs ended are forgotten after 2 s. The
    daemons' messages may take 30 s, not 10: the tests share two cores with training ranks, and a job whose launch
    message times out ends without running its script."""
    nodes = "\n".join(
        f"NodeName={name} NodeAddr={address} NodeHostname={socket.gethostname()} Port={ports[name]} "
        "CPUs=2 RealMemory=16000 State=UNKNOWN"
        for name, address in NODES.items()
    )
    return f"""ClusterName=textsqltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports["slurmctld"]}
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
SlurmdTimeout=10
MessageTimeout=30
MinJobAge=2
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged, slurmctld and one slurmd per node of :data:`NODES`, configured under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.conf = directory / "slurm.conf"
        self.munge = directory / "munge"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> str:
        """A Slurm client command against this cluster; its output."""
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
        return result.stdout

    def node_states(self) -> dict[str, str]:
        """Node -> its state as sinfo says it (``idle``, ``alloc``, ``down*``, ...)."""
        listed = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        return dict(line.split() for line in listed.splitlines() if len(line.split()) == 2)

    def jobs(self) -> list[str]:
        """Every job the controller lists as pending, running or completing: ``ID NAME STATE``."""
        return self.run("squeue", "--noheader", "--format=%i %j %T").splitlines()

    def start(self) -> SlurmCluster:
        """Start the daemons and return once both nodes are idle (or raise, with the logs' last lines)."""
        for sub in ("state", "log", *(f"spool/{name}" for name in NODES)):
            (self.directory / sub).mkdir(parents=True)
        self.munge.mkdir(mode=0o700)
        key = self.munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = self.munge / "munge.sock"
        ports = {name: free_port() for name in ("slurmctld", *NODES)}
        self.conf.write_text(slurm_conf(self.directory, ports, socket_path))
        subprocess.run(
            ["munged", "--force", f"--key-file={key}", f"--socket={socket_path}", f"--pid-file={self.munge}/munged.pid",
             f"--log-file={self.munge}/munged.log", f"--seed-file={self.munge}/munged.seed"],
            check=True, env=self.env,
        )  # fmt: skip
        subprocess.run(["slurmctld", "-i"], check=True, env=self.env)
        for name in NODES:
            subprocess.run(["slurmd", "-N", name], check=True, env=self.env)
        deadline = time.monotonic() + READY_S
        while set(self.node_states().values()) != {"idle"} or len(self.node_states()) != len(NODES):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {READY_S:.0f}s: {self.node_states()}; {self.logs()}")
            time.sleep(0.2)
        return self

    def daemon_logs(self) -> dict[str, list[str]]:
        """Every daemon's log by its file name: its lines."""
        return {
            log.name: log.read_text(errors="replace").splitlines()
            for log in sorted((self.directory / "log").glob("*.log"))
        }

    def logs(self) -> str:
        """The last lines of every daemon's log, for a failure's message."""
        return "\n".join(f"{name}: {' | '.join(lines[-5:])}" for name, lines in self.daemon_logs().items())

    def errors(self) -> str:
        """Every daemon's error lines (the last 20 of each): printed when a test ends, so a failed test shows why
        Slurm failed a job (a launch that timed out, say) beside its own message."""
        return "\n".join(
            f"{name}: {line}"
            for name, lines in self.daemon_logs().items()
            for line in [line for line in lines if "error" in line.lower()][-20:]
        )

    def set_node(self, node: str, state: str, reason: str = "test") -> None:
        """``scontrol update NodeName=NODE State=STATE``, as an administrator (or a failure) would."""
        self.run("scontrol", "update", f"NodeName={node}", f"State={state}", f"Reason={reason}")

    def stop(self) -> None:
        """Cancel every job and wait for the queue to empty, stop the daemons and then munged (each takes about 2 s to
        exit: the Slurm daemons are stopped together, then munged, which they use until they exit), end whatever of
        the cluster is left (a job step's ``slurmstepd`` whose slurmd went first waits for it for ever), and remove
        the directory."""
        self.run("scancel", "--user=root", check=False)
        deadline = time.monotonic() + STOP_S
        while self.conf.exists() and self.jobs() and time.monotonic() < deadline:
            time.sleep(0.1)
        slurm = [self.directory / f"slurmd-{name}.pid" for name in NODES] + [self.directory / "slurmctld.pid"]
        for pid_files in (slurm, [self.munge / "munged.pid"]):
            stopping = []
            for pid_file in pid_files:
                try:
                    pid = int(pid_file.read_text().split()[0])
                    os.kill(pid, signal.SIGTERM)
                except (OSError, ValueError, IndexError):
                    continue
                stopping.append(pid)
            deadline = time.monotonic() + STOP_S
            while stopping and time.monotonic() < deadline:
                stopping = [pid for pid in stopping if psutil.pid_exists(pid)]
                time.sleep(0.1)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.directory, ignore_errors=True)
        deadline = time.monotonic() + STOP_S
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            raise RuntimeError(f"processes of the Slurm cluster in {self.directory} outlived it: {left}")

    def processes(self) -> list[int]:
        """The processes started with this cluster's ``SLURM_CONF`` (its daemons, job steps and what they ran), this
        test's own process aside."""
        return marked_processes(str(self.conf), "SLURM_CONF")


def new_cluster() -> SlurmCluster:
    """A cluster in a fresh directory under /tmp, started."""
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp")))
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise
