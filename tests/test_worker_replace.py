"""A lost worker replaced through the cml and kubernetes backends (``Cluster.replace_worker``).

The platforms are emulated (tests/fakes: CML's ``cml.workers_v1`` and a Kubernetes API server with a
kubelet), the rest is real: each "engine" or "pod" is a local agent process with its own sshd on its
own loopback address, registering over the real authenticated rendezvous; the replacement's host key
is checked by a real ssh login through the run's ssh_config.
"""

from __future__ import annotations

import time

import psutil
import pytest
from fakes.kubernetes_api import KubeletCoreV1, RecordingNetworkingV1
from helpers.paths import PROJECT_DIR
from kubernetes.client import ApiClient

from worker.backends.kubernetes import APP_LABEL, KubernetesBackend
from worker.backends.kubernetes_options import KubernetesOptions
from worker.cluster import Cluster, start_workers
from worker.errors import WorkerError

pytestmark = pytest.mark.slow
LOST = "127.0.0.3"  # the second of two workers; the replacement gets the next new address
NEW = "127.0.0.4"


def pinned_keys(cluster: Cluster) -> dict[str, str]:
    """known_hosts as address -> key (lines are ``[ADDRESS]:PORT TYPE KEY``)."""
    keys = {}
    for line in cluster.known_hosts.read_text().splitlines():
        host, key = line.split(" ", 1)
        keys[host.split("]")[0].lstrip("[")] = key
    return keys


def running(process: psutil.Process) -> bool:
    """Alive: not gone, and not a zombie waiting for its parent to read its exit status."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill(processes: list[psutil.Process]) -> None:
    """SIGKILL each and wait until it is dead. The emulators' engines and pods are this process's
    children, left unreaped so the emulators read their exit status as the platform would."""
    for process in processes:
        process.kill()
    for _ in range(600):
        if not any(running(process) for process in processes):
            return
        time.sleep(0.05)


def assert_replaced(before: Cluster, after: Cluster, keys_before: dict[str, str]) -> None:
    """The replacement registered at a new address with a new key, pinned and written; the other worker kept."""
    assert after.hosts == ["127.0.0.2", NEW]
    assert after.hostfile.read_text() == f"127.0.0.2 slots=1\n{NEW} slots=1\n"
    keys = pinned_keys(after)
    assert set(keys) == {"127.0.0.2", NEW} and keys["127.0.0.2"] == keys_before["127.0.0.2"]
    assert keys[NEW] not in keys_before.values()
    result = after.ssh(NEW, "echo replaced")  # StrictHostKeyChecking yes against the pinned key
    assert result.returncode == 0 and result.stdout == "replaced\n", result.stderr
    assert next(w.pod for w in after.workers) == before.workers[0].pod and after.lost() == {}


@pytest.fixture
def kubernetes_cluster(tmp_path, monkeypatch):
    """Two pods on the emulated API server; yields (cluster, api)."""
    monkeypatch.setenv("POD_IP", "127.0.0.1")  # the session's own pod, where the rendezvous listens
    api = KubeletCoreV1(tmp_path / "kubelet")
    options = KubernetesOptions(image="img", poll_s=0.05, project_path=str(PROJECT_DIR))
    backend = KubernetesBackend(options, api=api, networking_api=RecordingNetworkingV1())
    try:
        with start_workers(backend, 2, tmp_path / "run", timeout=60, ssh_port=0) as cluster:
            yield cluster, api
    finally:
        api.close()


@pytest.mark.parametrize("how", ["container killed", "pod deleted", "sshd unreachable"])
def test_a_lost_kubernetes_pod_is_replaced_by_a_copy_that_registers_with_a_new_key(kubernetes_cluster, how):
    cluster, api = kubernetes_cluster
    lost = cluster.workers[1].pod
    keys_before, spec_before = pinned_keys(cluster), ApiClient().sanitize_for_serialization(api.pods[lost])
    agent = psutil.Process(api.processes[lost].pid)
    processes = [agent, *agent.children(recursive=True)]
    if how == "container killed":  # the OOM killer: the Pod object stays, Failed
        kill(processes)
        assert api.status_of(lost)[0] == "Failed"
    elif how == "pod deleted":  # an eviction: the Pod object is gone
        api.delete_namespaced_pod(lost, "default", grace_period_seconds=10)
    else:  # the Pod still Running but its sshd does not answer: the replacement must delete it
        kill([p for p in processes if "sshd" in p.name()])
        assert api.status_of(lost)[0] == "Running"
    replaced = cluster.replace_worker(LOST, timeout=60)
    new = replaced.workers[1].pod
    assert new == f"{lost}-r1" and lost not in api.pods and lost not in api.processes
    assert not any(running(process) for process in processes), "the lost pod's agent is still running"
    assert_replaced(cluster, replaced, keys_before)
    # The same Pod under a new name, with its own key's Secret: spec and labels (what `textsql workers cleanup`
    # selects by) otherwise unchanged.
    spec = ApiClient().sanitize_for_serialization(api.pods[new])
    assert spec["metadata"].pop("annotations") == {"textsql/replaces": lost}
    key_volume = next(volume for volume in spec["spec"]["volumes"] if volume["name"] == "token")
    assert key_volume["secret"]["secretName"] == f"{new}-key" and f"{new}-key" in api.secrets
    key_volume["secret"]["secretName"] = f"{lost}-key"
    assert {**spec, "metadata": {**spec["metadata"], "name": lost}} == spec_before
    assert api.selected(api.pods[new], f"{APP_LABEL},textsql/run={cluster.backend.run_id}")
    assert [pod.pod for pod in cluster.backend.pods] == [cluster.workers[0].pod, new]


def test_a_kubernetes_replacement_that_never_runs_fails_at_the_deadline_naming_why(kubernetes_cluster):
    cluster, api = kubernetes_cluster
    lost = cluster.workers[1].pod
    api.image_pull_fails = True
    api.delete_namespaced_pod(lost, "default", grace_period_seconds=10)
    with pytest.raises(
        WorkerError,
        match=rf"no replacement for lost worker {LOST} \(pod {lost}\) registered within 1s: "
        rf"pods not running after 1s: {lost}-r1 \(ImagePullBackOff\); check image, quota",
    ):
        cluster.replace_worker(LOST, timeout=1)


def engine_id(cluster: Cluster, pod: str) -> str:
    """The CML engine id of the worker named ``pod`` (the backend's handles say ``engine ID``)."""
    return next(handle.detail.split(",")[0].split()[-1] for handle in cluster.backend.pods if handle.pod == pod)


def engine_processes(engine: str) -> list[psutil.Process]:
    """A CML engine's processes (the emulator's engine, its agent, that agent's sshd), found by CDSW_ENGINE_ID."""
    for process in psutil.process_iter():
        try:
            if (
                process.environ().get("CDSW_ENGINE_ID") == engine
                and process.parent().environ().get("CDSW_ENGINE_ID") != engine
            ):
                return [process, *process.children(recursive=True)]
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    raise AssertionError(f"no process of engine {engine}")


@pytest.fixture
def cml_cluster(cml_emulator, tmp_path):
    with start_workers("cml", 2, tmp_path / "run", timeout=60, master_address="127.0.0.1", ssh_port=0) as cluster:
        yield cluster, cml_emulator


@pytest.mark.parametrize("how, status", [("engine ended", "failed"), ("sshd unreachable", "stopped")])
def test_a_lost_cml_engine_is_replaced_by_a_new_engine_and_stopped_if_still_running(cml_cluster, how, status):
    cluster, api = cml_cluster
    lost = cluster.workers[1].pod
    lost_engine = engine_id(cluster, lost)
    keys_before, processes = pinned_keys(cluster), engine_processes(lost_engine)
    # Ended: the engine was preempted. Unreachable: CML still lists it running, so it must be stopped.
    kill(processes if how == "engine ended" else [p for p in processes if "sshd" in p.name()])
    replaced = cluster.replace_worker(LOST, timeout=60)
    new = replaced.workers[1].pod
    states = {w["id"]: w["status"] for w in api.list_workers()}
    assert new == f"{lost}-r1" and states[lost_engine] == status and states[engine_id(cluster, new)] == "running"
    assert not any(running(process) for process in processes), "the lost engine's agent is still running"
    assert [pod.pod for pod in cluster.backend.pods] == [cluster.workers[0].pod, new]
    assert_replaced(cluster, replaced, keys_before)


def test_a_cml_replacement_that_fails_is_reported_with_its_status(cml_cluster):
    cluster, _api = cml_cluster
    kill(engine_processes(engine_id(cluster, cluster.workers[1].pod)))
    cluster.backend._options["code"] = "raise SystemExit(1)"  # the new engine fails at once, as a bad image would
    with pytest.raises(
        WorkerError,
        match=rf"no replacement for lost worker {LOST} .* registered within 60s: "
        r"worker \S+ ended with status 'failed' before registering",
    ):
        cluster.replace_worker(LOST, timeout=60)


def test_without_a_replacement_the_run_goes_on_with_the_workers_left(kubernetes_cluster):
    """What the supervisor does when min_workers allows: the lost worker is dropped and the run's files follow."""
    cluster, api = kubernetes_cluster
    lost = cluster.workers[1].pod
    keys_before = pinned_keys(cluster)
    api.image_pull_fails = True
    api.delete_namespaced_pod(lost, "default", grace_period_seconds=10)
    with pytest.raises(WorkerError, match="no replacement for lost worker"):
        cluster.replace_worker(LOST, timeout=1)
    smaller = cluster.without_worker(LOST)
    assert smaller.hosts == ["127.0.0.2"] and smaller.master_addr == "127.0.0.2"
    assert smaller.hostfile.read_text() == "127.0.0.2 slots=1\n"
    assert pinned_keys(smaller) == {"127.0.0.2": keys_before["127.0.0.2"]}
    assert smaller.lost() == {}, "the dropped worker would read as lost again at the next failure"
    result = smaller.ssh("127.0.0.2", "echo kept")
    assert result.returncode == 0 and result.stdout == "kept\n", result.stderr
    with pytest.raises(WorkerError, match=r"127.0.0.2 is the run's last worker; there is nothing to go on with"):
        smaller.without_worker("127.0.0.2")
