"""The master's store, tracking and hub credentials reach no worker, on any backend (issue 55, finding 1).

A worker gets an allow-list: the runtime's variables (interpreter, libraries, caches, locale, who the user is),
the rendezvous settings, its own key and what the run names; never the master's environment minus a deny-list.
Each launching backend starts real agents here (``local`` processes, the CML and Kubernetes emulators' engines
and pods, jobs of a real two-node Slurm) while the master's environment holds a credential of every kind, and
every process of those workers is read for them, by name and by value. ``static`` hosts get only what ssh sends.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import psutil
import pytest
from fakes.kubernetes_api import KubeletCoreV1, RecordingNetworkingV1
from helpers.paths import PROJECT_DIR

from worker import constants as c
from worker.backends.kubernetes import KubernetesBackend
from worker.backends.kubernetes_options import KubernetesOptions
from worker.cluster import Cluster, start_workers
from worker.errors import WorkerError

pytestmark = pytest.mark.slow
# Store (S3, Azure), tracking (MLflow) and hub (Hugging Face) credentials, each with a value no other test has.
CREDENTIALS = {
    name: f"canary-{secrets.token_hex(8)}"
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
        "MLFLOW_TRACKING_PASSWORD",
        "HF_TOKEN",
    )
}
# A variable the run names (start_workers' env): it must reach every worker, as the rendezvous settings do.
NAMED = {"TEXTSQL_TEST_NAMED": "named-by-the-run"}
# Register-only agents (no sshd): what is checked is the agents' environment, not their ssh.
REGISTER_ONLY = {c.ENV_SSHD: "0", **NAMED}
WORKERS = 2


@pytest.fixture
def master_credentials(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Every credential in the master's environment, as a user with a store, MLflow and the hub has them."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    return CREDENTIALS


def worker_environments(cluster: Cluster) -> list[dict[str, str]]:
    """The environment of every process of this run's workers (agents, engines, jobs and their children): those
    whose environment points at this run's rendezvous."""
    rendezvous = f"{cluster.rendezvous[0]}:{cluster.rendezvous[1]}"
    found = []
    for process in psutil.process_iter():
        try:
            environ = process.environ()
        except (psutil.Error, OSError):
            continue
        if environ.get(c.ENV_RENDEZVOUS) == rendezvous:
            found.append(environ)
    return found


def assert_no_credential_reached(cluster: Cluster) -> None:
    environments = worker_environments(cluster)
    pods = {environ.get(c.ENV_POD) for environ in environments}
    assert len(pods) >= WORKERS, f"found the processes of {sorted(map(str, pods))} only"
    leaked = sorted(
        {
            f"{environ.get(c.ENV_POD)}: {name}"
            for environ in environments
            for name, value in environ.items()
            if name in CREDENTIALS or value in CREDENTIALS.values()
        }
    )
    assert not leaked, f"the master's credentials reached workers: {leaked}"
    assert all(environ.get(name) == value for environ in environments for name, value in NAMED.items())


def test_local_workers_get_no_credential_of_the_master(master_credentials, tmp_path):
    with start_workers("local", WORKERS, tmp_path / "run", timeout=60, env=NAMED, sshd=False) as cluster:
        assert_no_credential_reached(cluster)


def test_cml_engines_get_no_credential_of_the_master(master_credentials, cml_emulator, tmp_path):
    run_dir = tmp_path / "run"
    with start_workers("cml", WORKERS, run_dir, timeout=60, master_address="127.0.0.1", env=REGISTER_ONLY) as cluster:
        assert_no_credential_reached(cluster)  # an engine starts from its image's variables and launch_workers' env


@pytest.fixture
def kubelet(tmp_path) -> Iterator[KubeletCoreV1]:
    api = KubeletCoreV1(tmp_path / "kubelet")
    yield api
    api.close()


def test_kubernetes_pods_get_no_credential_of_the_master(master_credentials, kubelet, tmp_path, monkeypatch):
    monkeypatch.setenv("POD_IP", "127.0.0.1")  # the session's own pod, where the rendezvous listens
    options = KubernetesOptions(image="img", poll_s=0.05, project_path=str(PROJECT_DIR))
    backend = KubernetesBackend(options, api=kubelet, networking_api=RecordingNetworkingV1())
    with start_workers(backend, WORKERS, tmp_path / "run", timeout=60, env=REGISTER_ONLY) as cluster:
        assert_no_credential_reached(cluster)
        for pod in kubelet.pods.values():
            names = {variable.name for variable in pod.spec.containers[0].env}
            assert not names & set(CREDENTIALS), f"pod {pod.metadata.name}'s spec names a credential"


def test_slurm_jobs_get_no_credential_of_the_master(master_credentials, slurm_cluster, tmp_path):
    """A real Slurm: each job's environment is sbatch's ``--export`` list, which names no credential."""
    with start_workers("slurm", WORKERS, tmp_path / "run", timeout=60, env=REGISTER_ONLY) as cluster:
        assert_no_credential_reached(cluster)
    with (
        pytest.raises(WorkerError, match=r"^cannot pass 'NOT-A-NAME' to the Slurm jobs .*; rename the variable"),
        start_workers("slurm", WORKERS, tmp_path / "run2", timeout=60, env={"NOT-A-NAME": "x"}),
    ):
        pass
    assert slurm_cluster.jobs() == [], "a job was submitted before the name was refused"


def test_static_hosts_are_sent_no_credential_of_the_master(master_credentials, loopback_sshd, tmp_path):
    sshd, identity = loopback_sshd
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.2]:{sshd.port} {sshd.host_public_key}\n")
    with start_workers(
        "static",
        1,
        tmp_path / "run",
        ssh_port=sshd.port,
        hosts=["127.0.0.2"],
        identity_file=identity,
        known_hosts=known_hosts,
    ) as cluster:
        result = cluster.ssh("127.0.0.2", "env")
        assert result.returncode == 0 and "PATH=" in result.stdout, result.stderr
        assert not [value for value in CREDENTIALS.values() if value in result.stdout]
        assert not [name for name in CREDENTIALS if f"{name}=" in result.stdout]
