"""The cml (through an emulator of cml.workers_v1), kubernetes (pod specs, a recording API stand-in) and static
(real sshd) backends; the interface every backend honours is in test_backend_interface.py."""

from __future__ import annotations

import re
import secrets
import sys
import types
from pathlib import Path

import pytest
from fakes.kubernetes_api import KubeletCoreV1, RecordingCoreV1, RecordingNetworkingV1

from worker import constants as c
from worker.backends import Resources, make_backend
from worker.backends.cml import CMLBackend
from worker.backends.kubernetes import KubernetesBackend
from worker.backends.kubernetes_manifests import secret_manifest
from worker.backends.kubernetes_options import KubernetesOptions
from worker.backends.kubernetes_policy import network_policy_manifest, parse_egress, tracking_egress
from worker.cluster import start_workers
from worker.errors import WorkerError
from worker.rendezvous.token import new_token, pod_key, read_token
from worker.sshd import generate_keypair


@pytest.mark.slow
def test_cml_backend_runs_agents_as_engines_and_stops_them(cml_emulator, tmp_path):
    with start_workers(
        "cml",
        2,
        tmp_path / "run",
        timeout=60,
        master_address="127.0.0.1",
        ssh_port=0,
        resources=Resources(cpu=1, memory_gb=2),
    ) as cluster:
        assert [w.pod for w in cluster.workers] == ["textsql-worker-0", "textsql-worker-1"]
        ids = [h.detail.split()[-1] for h in cluster.backend.pods]
        assert all(i.startswith("emu") for i in ids) and len(cluster.hostfile.read_text().splitlines()) == 2
        result = cluster.ssh(cluster.hosts[0], "echo hello from $(hostname)")
        assert result.returncode == 0 and result.stdout.startswith("hello from"), result.stderr
    states = {w["id"]: w["status"] for w in cml_emulator.list_workers()}
    assert all(states[i] in ("stopped", "succeeded") for i in ids)


def test_cml_backend_passes_the_gpu_type_and_placement_only_when_given(cml_emulator, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text("pass\n")
    chosen = CMLBackend(script=str(script), accelerator_label_id=3, resource_group_id=7)
    plain = CMLBackend(script=str(script))
    env = {c.ENV_TOKEN: secrets.token_hex(32)}  # what start_workers gives a backend
    try:
        chosen.launch(1, Resources(cpu=1, memory_gb=2, gpus=1), env)
        plain.launch(1, Resources(cpu=1, memory_gb=2), env)
    finally:
        chosen.stop()
        plain.stop()
    assert cml_emulator.launches[-2:] == [
        {"n": 1, "accelerator_label_id": 3, "resource_profile_id": None, "resource_group_id": 7},
        {"n": 1, "accelerator_label_id": None, "resource_profile_id": None, "resource_group_id": None},
    ]


def test_cml_backend_refuses_a_placement_its_release_lacks(tmp_path):
    older = types.SimpleNamespace(launch_workers=lambda n, cpu, memory, nvidia_gpu=0, code="", env={}: [])
    with pytest.raises(WorkerError, match="takes no accelerator_label_id; leave it out of backend_options"):
        CMLBackend(api=older, accelerator_label_id=3).launch(
            1, Resources(cpu=1, memory_gb=2), {c.ENV_TOKEN: secrets.token_hex(32)}
        )


def test_cml_backend_outside_cml_says_what_to_use(monkeypatch):
    for name in ("cml", "cml.workers_v1", "cdsw"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(WorkerError, match="only available inside a CML session; use backend='local'"):
        make_backend("cml")


def test_unknown_backend_lists_the_choices():
    with pytest.raises(
        WorkerError, match="unknown worker backend 'lsf'; choose one of local, cml, kubernetes, slurm, static"
    ):
        make_backend("lsf")


def k8s_backend() -> KubernetesBackend:
    options = KubernetesOptions(
        image="registry.example.com/textsql:1.0",
        namespace="ml",
        project_claim="project-pvc",
        project_path="/home/cdsw",
        node_selector={"gpu": "a100"},
    )
    backend = KubernetesBackend(options, api=object())
    backend.run_id, backend.workdir = "demo-abc123", Path("/home/cdsw/runs/demo/workers")  # as start_workers sets it
    return backend


def test_kubernetes_pod_spec_through_the_clients_models():
    from kubernetes.client import ApiClient

    token = secrets.token_urlsafe(32)
    env = {
        c.ENV_RENDEZVOUS: "10.0.0.4:29400",
        c.ENV_TOKEN_FILE: "/home/cdsw/runs/demo/rendezvous.token",
        c.ENV_CLIENT_PUBKEY: "ssh-ed25519 AAAA run",
        c.ENV_SSH_PORT: "2222",
    }
    pod = ApiClient().sanitize_for_serialization(k8s_backend().pod_spec(1, Resources(cpu=8, memory_gb=64, gpus=4), env))
    assert pod["metadata"] == {
        "name": "textsql-demo-abc123-1",
        "namespace": "ml",
        "labels": {"app.kubernetes.io/name": "textsql-worker", "textsql/run": "demo-abc123"},
    }
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["nodeSelector"] == {"gpu": "a100"}
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["image"] == "registry.example.com/textsql:1.0"
    assert container["args"] == ["python", "-m", "worker.agent"] and "command" not in container  # tini stays pid 1
    assert container["workingDir"] == "/home/cdsw"
    assert container["resources"]["limits"] == {
        "cpu": "8",
        "memory": "64Gi",
        "ephemeral-storage": "20Gi",
        "nvidia.com/gpu": "4",
    }
    values = {e["name"]: e.get("value") for e in container["env"]}
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert values[c.ENV_TOKEN_FILE] == "/var/run/textsql/token" and values[c.ENV_SLOTS] == "4"
    assert values[c.ENV_RENDEZVOUS] == "10.0.0.4:29400"
    assert refs == {"POD_IP": "status.podIP", c.ENV_POD: "metadata.name"}
    assert [(m["name"], m["mountPath"], m.get("readOnly"), m.get("subPath")) for m in container["volumeMounts"]] == [
        ("token", "/var/run/textsql", True, None),
        ("shm", "/dev/shm", None, None),
        ("tmp", "/tmp", None, None),
        ("cache", "/home/textsql/.cache", None, None),
        ("project", "/home/cdsw", True, None),  # the code the master imports: read-only
        ("project", "/home/cdsw/runs/demo", False, "runs/demo"),  # the run directory: read-write
    ]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["token"]["secret"] == {"secretName": "textsql-demo-abc123-1-key", "defaultMode": 0o440}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["activeDeadlineSeconds"] == 7 * 24 * 3600  # a week: a backstop, above any planned run
    assert values[c.ENV_TOKEN_GROUP] == "1000" and values[c.ENV_SSHD_KEYS_DIR] == "/tmp/textsql-sshd"
    assert volumes["project"]["persistentVolumeClaim"] == {"claimName": "project-pvc"}
    assert token not in str(pod)
    key = pod_key(token, "textsql-demo-abc123-1")
    secret = ApiClient().sanitize_for_serialization(secret_manifest("demo-abc123", "textsql-demo-abc123-1", key))
    assert secret["stringData"] == {"token": key} and secret["metadata"]["name"] == "textsql-demo-abc123-1-key"


def test_kubernetes_network_policy_admits_sshd_from_the_master_alone_and_lets_out_what_a_run_needs():
    from kubernetes.client import ApiClient

    policy = ApiClient().sanitize_for_serialization(
        network_policy_manifest("ml", "demo-abc123", "10.0.0.4", 29400, 2222)
    )
    run = {"app.kubernetes.io/name": "textsql-worker", "textsql/run": "demo-abc123"}
    assert policy["metadata"] == {"name": "textsql-demo-abc123-workers", "namespace": "ml", "labels": run}
    assert policy["spec"]["podSelector"] == {"matchLabels": run}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    all_but_sshd = [
        {"protocol": "TCP", "port": 1, "endPort": 2221},
        {"protocol": "TCP", "port": 2223, "endPort": 65535},
    ]
    ssh, ranks = policy["spec"]["ingress"]
    assert ssh == {"from": [{"ipBlock": {"cidr": "10.0.0.4/32"}}], "ports": [{"protocol": "TCP", "port": 2222}]}
    assert ranks == {"from": [{"podSelector": {"matchLabels": run}}], "ports": all_but_sshd}
    rendezvous, to_ranks, dns = policy["spec"]["egress"]
    assert rendezvous == {"to": [{"ipBlock": {"cidr": "10.0.0.4/32"}}], "ports": [{"protocol": "TCP", "port": 29400}]}
    assert to_ranks == {"to": [{"podSelector": {"matchLabels": run}}], "ports": all_but_sshd}
    assert dns == {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }


def test_kubernetes_network_policy_takes_the_master_by_its_ip_alone():
    policy = network_policy_manifest("ml", "demo-abc123", "fd00::4", 29400, 2222)
    assert policy.spec.egress[0].to[0].ip_block.cidr == "fd00::4/128"
    with pytest.raises(
        WorkerError, match="master address 'jupyter.ml.svc' is not an IP address.*; pass master_address="
    ):
        network_policy_manifest("ml", "demo-abc123", "jupyter.ml.svc", 29400, 2222)


def test_kubernetes_network_policy_lets_out_only_the_extra_destinations_asked_for():
    from kubernetes.client import ApiClient

    plain = network_policy_manifest("ml", "demo-abc123", "10.0.0.4", 29400, 2222)
    extra = [parse_egress("10.0.3.7:5000"), parse_egress("[fd00::/64]:443")]
    policy = ApiClient().sanitize_for_serialization(
        network_policy_manifest("ml", "demo-abc123", "10.0.0.4", 29400, 2222, extra)
    )
    assert policy["spec"]["egress"][:3] == ApiClient().sanitize_for_serialization(plain)["spec"]["egress"]
    assert policy["spec"]["egress"][3:] == [
        {"to": [{"ipBlock": {"cidr": "10.0.3.7/32"}}], "ports": [{"protocol": "TCP", "port": 5000}]},
        {"to": [{"ipBlock": {"cidr": "fd00::/64"}}], "ports": [{"protocol": "TCP", "port": 443}]},
    ]
    for entry in ("mlflow.example.com:443", "10.0.3.7", "10.0.3.7:0", "10.0.3.7:http"):
        with pytest.raises(WorkerError, match=r"is not IP\[/PREFIX\]:PORT; pass e.g. egress="):
            parse_egress(entry)


def test_kubernetes_backend_lets_pods_reach_the_tracking_server_only_when_asked(tmp_path, monkeypatch):
    assert tracking_egress("https://127.0.0.1/") == [("127.0.0.1/32", 443)]
    # A name is resolved where the master runs, each of its addresses allowed.
    assert ("127.0.0.1/32", 5000) in tracking_egress("http://localhost:5000")
    with pytest.raises(WorkerError, match="no http\\(s\\) server") as refused:
        tracking_egress("databricks://alice:hunter2@profile")
    assert "hunter2" not in str(refused.value)
    token_file = tmp_path / "token"
    new_token(token_file)
    env = {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:29400"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.0.3.7:5000")
    for asked, destinations in ((False, []), (True, [("10.0.3.7/32", 5000)])):
        networking = RecordingNetworkingV1()
        backend = KubernetesBackend(
            KubernetesOptions(image="img", egress_to_tracking=asked), api=RecordingCoreV1(), networking_api=networking
        )
        backend.launch(1, Resources(), env)
        (policy,) = networking.policies.values()
        assert [(rule.to[0].ip_block.cidr, rule.ports[0].port) for rule in policy.spec.egress[3:]] == destinations
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(WorkerError, match="egress_to_tracking needs MLFLOW_TRACKING_URI set"):
        KubernetesBackend(KubernetesOptions(image="img", egress_to_tracking=True), api=object())


def test_notebook_backend_options_reach_the_kubernetes_options_key_by_key():
    """Notebook 02's backend_options dict, as start_workers passes it; a misspelt key is one line naming it."""
    backend = make_backend("kubernetes", image="img", namespace="ml", egress=["10.0.3.7:5000"], api=object())
    assert backend.options == KubernetesOptions(image="img", namespace="ml", egress=["10.0.3.7:5000"])
    assert backend.options.project_path == str(Path.cwd()) and backend.egress == [("10.0.3.7/32", 5000)]
    with pytest.raises(WorkerError, match=r"bad option for the 'kubernetes' backend: .*'namespce'"):
        make_backend("kubernetes", image="img", namespce="ml")


def test_kubernetes_cpu_pod_asks_for_no_gpu():
    pod = k8s_backend().pod_spec(0, Resources(cpu=2, memory_gb=8, gpus=0), {c.ENV_TOKEN_FILE: "/x"})
    assert "nvidia.com/gpu" not in pod.spec.containers[0].resources.limits


@pytest.fixture
def static_host(loopback_sshd, tmp_path):
    """A real sshd on 127.0.0.2 standing in for an existing host, with the user's key and known_hosts."""
    sshd, identity = loopback_sshd
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.2]:{sshd.port} {sshd.host_public_key}\n")
    return {
        "port": sshd.port,
        "identity": identity,
        "known_hosts": known_hosts,
        "key": " ".join(sshd.host_public_key.split()[:2]),
    }


@pytest.mark.slow
def test_static_hosts_are_checked_over_ssh_and_written(static_host, tmp_path):
    with start_workers(
        "static",
        1,
        tmp_path / "run",
        ssh_port=static_host["port"],
        hosts=["127.0.0.2 slots=2"],
        identity_file=static_host["identity"],
        known_hosts=static_host["known_hosts"],
    ) as cluster:
        assert cluster.hostfile.read_text() == "127.0.0.2 slots=2\n"
        assert cluster.known_hosts.read_text() == f"[127.0.0.2]:{static_host['port']} {static_host['key']}\n"
        result = cluster.ssh("127.0.0.2", "echo ok")
        assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
        assert [pod.pod for pod in cluster.backend.pods] == ["127.0.0.2"]
        # The hosts may share the run directory (the store guide's NFS): what ssh reads lies in a private directory.
        private = cluster.ssh_config.parent
        assert {cluster.hostfile.parent, cluster.known_hosts.parent} == {private} and private != cluster.run_dir
        assert oct(private.stat().st_mode & 0o777) == "0o700" and not private.is_relative_to(cluster.run_dir)
        assert not {"hostfile", "known_hosts", "ssh_config"} & {path.name for path in cluster.run_dir.iterdir()}
    assert list(cluster.backend.pods) == [] and not private.exists()


@pytest.mark.slow
def test_static_host_with_unknown_key_is_refused_with_the_fix(static_host, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with (
        pytest.raises(WorkerError, match=r"no host key for \[127.0.0.2\]:\d+ .*ssh-keyscan -p"),
        start_workers(
            "static",
            1,
            tmp_path / "run",
            ssh_port=static_host["port"],
            hosts=["127.0.0.2"],
            identity_file=static_host["identity"],
            known_hosts=empty,
        ),
    ):
        pass
    stranger = tmp_path / "stranger"
    generate_keypair(stranger, "stranger")
    with (
        pytest.raises(WorkerError, match=r"cannot ssh to 127.0.0.2:\d+: .*Permission denied"),
        start_workers(
            "static",
            1,
            tmp_path / "run",
            ssh_port=static_host["port"],
            hosts=["127.0.0.2"],
            identity_file=stranger,
            known_hosts=static_host["known_hosts"],
        ),
    ):
        pass
    assert not (tmp_path / "run" / "hostfile").exists()


def test_kubernetes_launch_wait_stop_cleans_up_pods_and_secrets(tmp_path):
    token_file = tmp_path / "token"
    new_token(token_file)
    api, networking = RecordingCoreV1(), RecordingNetworkingV1()
    backend = KubernetesBackend(KubernetesOptions(image="img", poll_s=0.01), api=api, networking_api=networking)
    handles = backend.launch(
        2, Resources(gpus=1), {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:29400"}
    )
    # One Secret per pod, holding that pod's key and not the run's token.
    assert [h.pod for h in handles] == sorted(api.pods) and sorted(api.secrets) == [f"{h.pod}-key" for h in handles]
    token = read_token(token_file)
    assert [api.secrets[f"{h.pod}-key"].string_data for h in handles] == [
        {"token": pod_key(token, h.pod)} for h in handles
    ]
    assert sorted(networking.policies) == [f"textsql-{backend.run_id}-workers"]
    backend.wait(timeout=5)
    backend.stop()
    assert api.pods == {} and api.secrets == {} and networking.policies == {}


@pytest.mark.parametrize(
    "fake, real",
    [(RecordingCoreV1, "CoreV1Api"), (KubeletCoreV1, "CoreV1Api"), (RecordingNetworkingV1, "NetworkingV1Api")],
)
def test_the_kubernetes_stand_ins_have_only_the_clients_own_methods(fake, real):
    """The backend calls a stand-in exactly as it calls the pinned client: the same methods, parameter names
    and required parameters (so no production branch can tell them apart)."""
    import inspect

    from kubernetes import client

    real_class = getattr(client, real)
    calls = [name for name in vars(fake) if re.match(r"(create|list|read|patch|replace|delete)_", name)]
    assert calls
    for name in calls:
        ours = inspect.signature(getattr(fake, name)).parameters
        theirs = inspect.signature(getattr(real_class, name)).parameters
        assert list(ours) == [p for p in theirs if p in ours], name  # same names, same order
        assert [p for p in ours if ours[p].default is inspect.Parameter.empty] == [
            p for p in theirs if theirs[p].default is inspect.Parameter.empty and p != "kwargs"
        ], name


def test_kubernetes_pods_stuck_pending_are_named_with_their_reason(tmp_path):
    token_file = tmp_path / "token"
    new_token(token_file)
    backend = KubernetesBackend(
        KubernetesOptions(image="img", poll_s=0.01), api=RecordingCoreV1(phase="Pending", reason="ImagePullBackOff")
    )
    backend.launch(1, Resources(), {c.ENV_TOKEN_FILE: str(token_file)})
    with pytest.raises(WorkerError, match=r"pods not running after 0s: textsql-run-\w+-0 \(ImagePullBackOff\)"):
        backend.wait(timeout=0.05)
    backend.stop()
