"""What one worker pod holds cannot make it another worker: a real local cluster, real agents and sshd.

The attacker holds what a worker holds: the credential in a running agent's environment (its own key,
or on a run without per-pod keys the run token file it names). Host keys, addresses and pod names
are public (known_hosts, logs), so the attacker knows them all.
"""

from __future__ import annotations

import base64
import struct
import threading
import time
from pathlib import Path

import psutil
import pytest

from worker import constants as c
from worker.cluster import Cluster
from worker.registration import Registration
from worker.rendezvous.client import RegistrationRejected, register

pytestmark = pytest.mark.slow


def agent_credential(cluster: Cluster, pod: str) -> str:
    """The rendezvous credential the agent of ``pod`` holds, read from its process environment."""
    pid = next(int(h.detail.split()[-1]) for h in cluster.backend.pods if h.pod == pod)
    environ = psutil.Process(pid).environ()
    if environ.get(c.ENV_TOKEN):
        return environ[c.ENV_TOKEN]
    return Path(environ[c.ENV_TOKEN_FILE]).read_text().strip()


def attacker_key() -> str:
    blob = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32) + b"\x66" * 32
    return f"ssh-ed25519 {base64.b64encode(blob).decode()}"


def run_files(cluster: Cluster) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (cluster.hostfile, cluster.known_hosts, cluster.ssh_config)}


def test_a_worker_cannot_take_the_place_of_a_replacement(two_local_workers):
    """Hole 1: while local-1 is replaced, an impostor holding local-0's credential (or the lost pod's own)
    tries to register as the replacement; it is refused and the real replacement registers."""
    cluster = two_local_workers
    lost = cluster.workers[1]
    stolen = {"local-1-r1": agent_credential(cluster, "local-0"), lost.pod: agent_credential(cluster, lost.pod)}
    accepted, refusals = [], []
    done = threading.Event()

    def impostor() -> None:
        while not done.is_set():
            for pod, credential in stolen.items():
                fake = Registration("127.0.0.99", 1, "evil", pod, 2222, attacker_key(), "root")
                try:
                    accepted.append(register(cluster.rendezvous, credential, fake, source="127.0.0.99"))
                except RegistrationRejected as error:
                    refusals.append(str(error))
            time.sleep(0.02)

    attacker = threading.Thread(target=impostor)
    attacker.start()
    try:
        replaced = cluster.replace_worker(lost.address, timeout=60)
    finally:
        done.set()
        attacker.join()
    for session in accepted:
        session.close()
    assert accepted == [], f"the impostor registered; refusals before that: {refusals[-2:]}"
    assert [w.pod for w in replaced.workers] == ["local-0", "local-1-r1"]
    assert replaced.hostfile.read_text() == "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"
    assert attacker_key().split()[1] not in replaced.known_hosts.read_text()
    result = replaced.ssh("127.0.0.3", "echo real")
    assert result.returncode == 0 and result.stdout == "real\n", result.stderr


def test_a_registered_worker_cannot_be_registered_again(two_local_workers):
    """Hole 2: a second registration for a live worker (its own credential, address, host key and pod name)
    is refused, does not take over its held connection, and changes no run file."""
    cluster = two_local_workers
    live = cluster.workers[1]
    before = run_files(cluster)
    again = Registration(live.address, 16, "evil", live.pod, 1, live.host_key, "nobody")
    with pytest.raises(RegistrationRejected, match=f"pod '{live.pod}' is already registered"):
        register(cluster.rendezvous, agent_credential(cluster, live.pod), again, source=live.address).close()
    time.sleep(1)  # a taken-over connection, closed, would show as lost by now
    assert cluster.lost() == {}
    assert run_files(cluster) == before
    result = cluster.ssh(live.address, "echo still")
    assert result.returncode == 0 and result.stdout == "still\n", result.stderr


def test_kubernetes_workers_get_no_master_secret_through_the_project_volume(tmp_path, monkeypatch):
    """Weak point 6: with the project on a shared volume (the pods mount it read-only, their run directory
    read-write, as the master's user),
    the run's client key, token, ssh_config, known_hosts and hostfile are not on it, and each pod's Secret
    holds its own key, not the run token. Pods are local agents on an emulated API server."""
    from fakes.kubernetes_api import KubeletCoreV1, RecordingNetworkingV1

    from worker.backends.kubernetes import KubernetesBackend
    from worker.backends.kubernetes_options import KubernetesOptions
    from worker.cluster import start_workers
    from worker.rendezvous.token import pod_key

    monkeypatch.setenv("POD_IP", "127.0.0.1")
    project = tmp_path / "project"
    project.mkdir()
    api = KubeletCoreV1(tmp_path / "kubelet")
    options = KubernetesOptions(image="img", poll_s=0.05, project_claim="pvc", project_path=str(project))
    backend = KubernetesBackend(options, api=api, networking_api=RecordingNetworkingV1())
    try:
        with start_workers(backend, 2, project / "runs" / "r1", timeout=60, ssh_port=0) as cluster:
            secrets = [cluster.identity_file, cluster.ssh_config, cluster.known_hosts, cluster.hostfile]
            token = (cluster.hostfile.parent / c.TOKEN_NAME).read_text().strip()
            # What the pods mount from shared storage (their /tmp and caches are their own emptyDirs).
            spec = api.pods[cluster.workers[0].pod].spec
            claims = {v.name for v in spec.volumes if v.persistent_volume_claim is not None}
            shared = [Path(m.mount_path) for m in spec.containers[0].volume_mounts if m.name in claims]
            assert shared == [project, project / "runs" / "r1"]
            for path in [*secrets, cluster.hostfile.parent / c.TOKEN_NAME]:
                assert not any(path.is_relative_to(mount) for mount in shared), path
            assert not [p.name for p in (project / "runs" / "r1").iterdir() if p.is_file()]
            assert {name: body.string_data["token"] for name, body in api.secrets.items()} == {
                f"{w.pod}-key": pod_key(token, w.pod) for w in cluster.workers
            }
            result = cluster.ssh(cluster.hosts[1], "echo reached")
            assert result.returncode == 0 and result.stdout == "reached\n", result.stderr
        assert not cluster.hostfile.parent.exists()  # the master's copy goes with the workers
    finally:
        api.close()
