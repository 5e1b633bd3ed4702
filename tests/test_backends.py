"""The Backend interface every backend honours, and the cml (through an emulator of cml.workers_v1),
kubernetes (pod specs, a recording API stand-in) and static (real sshd) backends."""

from __future__ import annotations

import ipaddress
import secrets
import sys
import types
from pathlib import Path

import pytest
from fakes.kubernetes_api import RecordingCoreV1

from worker import constants as c
from worker.backends import BACKENDS, Backend, Resources, WorkerHandle, make_backend
from worker.backends.cml import CMLBackend
from worker.backends.kubernetes import KubernetesBackend
from worker.cluster import start_workers
from worker.errors import WorkerError
from worker.registration import Registration
from worker.rendezvous.client import register
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
    try:
        chosen.launch(1, Resources(cpu=1, memory_gb=2, gpus=1), {})
        plain.launch(1, Resources(cpu=1, memory_gb=2), {})
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
        CMLBackend(api=older, accelerator_label_id=3).launch(1, Resources(cpu=1, memory_gb=2), {})


def test_cml_backend_outside_cml_says_what_to_use(monkeypatch):
    for name in ("cml", "cml.workers_v1", "cdsw"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(WorkerError, match="only available inside a CML session; use backend='local'"):
        make_backend("cml")


def test_unknown_backend_lists_the_choices():
    with pytest.raises(
        WorkerError, match="unknown worker backend 'slurm'; choose one of local, cml, kubernetes, static"
    ):
        make_backend("slurm")


def k8s_backend() -> KubernetesBackend:
    backend = KubernetesBackend(
        image="registry.example.com/textsql:1.0",
        namespace="ml",
        project_claim="project-pvc",
        project_path="/home/cdsw",
        node_selector={"gpu": "a100"},
        api=object(),
    )
    backend.run_id = "demo-abc123"
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
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {
        "token": "/var/run/textsql",
        "project": "/home/cdsw",
        "shm": "/dev/shm",
        "tmp": "/tmp",
        "cache": "/home/textsql/.cache",
    }
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
    assert spec["activeDeadlineSeconds"] == 24 * 3600
    assert values[c.ENV_TOKEN_GROUP] == "1000" and values[c.ENV_SSHD_KEYS_DIR] == "/tmp/textsql-sshd"
    assert volumes["project"]["persistentVolumeClaim"] == {"claimName": "project-pvc"}
    assert token not in str(pod)
    key = pod_key(token, "textsql-demo-abc123-1")
    secret = ApiClient().sanitize_for_serialization(k8s_backend().secret_spec("textsql-demo-abc123-1", key))
    assert secret["stringData"] == {"token": key} and secret["metadata"]["name"] == "textsql-demo-abc123-1-key"


def test_kubernetes_network_policy_admits_sshd_from_the_master_alone():
    from kubernetes.client import ApiClient

    policy = ApiClient().sanitize_for_serialization(k8s_backend().network_policy("10.0.0.4", 2222))
    run = {"app.kubernetes.io/name": "textsql-worker", "textsql/run": "demo-abc123"}
    assert policy["metadata"] == {"name": "textsql-demo-abc123-workers", "namespace": "ml", "labels": run}
    assert policy["spec"]["podSelector"] == {"matchLabels": run} and policy["spec"]["policyTypes"] == ["Ingress"]
    ssh, ranks = policy["spec"]["ingress"]
    assert ssh == {"from": [{"ipBlock": {"cidr": "10.0.0.4/32"}}], "ports": [{"protocol": "TCP", "port": 2222}]}
    assert ranks == {
        "from": [{"podSelector": {"matchLabels": run}}],
        "ports": [
            {"protocol": "TCP", "port": 1, "endPort": 2221},
            {"protocol": "TCP", "port": 2223, "endPort": 65535},
        ],
    }


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
    assert list(cluster.backend.pods) == []


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
    api = RecordingCoreV1()
    backend = KubernetesBackend(image="img", api=api, poll_s=0.01)
    handles = backend.launch(
        2, Resources(gpus=1), {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:29400"}
    )
    # One Secret per pod, holding that pod's key and not the run's token.
    assert [h.pod for h in handles] == sorted(api.pods) and sorted(api.secrets) == [f"{h.pod}-key" for h in handles]
    token = read_token(token_file)
    assert [api.secrets[f"{h.pod}-key"].string_data for h in handles] == [
        {"token": pod_key(token, h.pod)} for h in handles
    ]
    assert sorted(api.policies) == [f"textsql-{backend.run_id}-workers"]
    backend.wait(timeout=5)
    backend.stop()
    assert api.pods == {} and api.secrets == {} and api.policies == {}


def test_workers_cleanup_deletes_a_dead_runs_pods_and_secrets_by_label(tmp_path, monkeypatch):
    """The kernel died without stop(): `textsql workers cleanup --run` finds its Pods and Secrets by label."""
    from click.testing import CliRunner

    from textsql.cli import cli
    from worker.backends import kubernetes

    token_file = tmp_path / "token"
    new_token(token_file)
    api = RecordingCoreV1()
    dead, alive = (KubernetesBackend(image="img", api=api) for _ in range(2))
    for backend in (dead, alive):
        backend.launch(2, Resources(), {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:1"})
    monkeypatch.setattr(kubernetes, "connect", lambda: api)
    result = CliRunner().invoke(cli, ["workers", "cleanup", "--namespace", "default", "--run", dead.run_id])
    assert result.exit_code == 0, result.output
    assert "deleted 2 pods and 2 secrets" in result.output
    assert sorted(api.pods) == [p.pod for p in alive.pods] and len(api.secrets) == 2
    result = CliRunner().invoke(cli, ["workers", "cleanup"])
    assert result.exit_code == 0 and api.pods == {} and api.secrets == {} and api.policies == {}, result.output


def test_kubernetes_pods_stuck_pending_are_named_with_their_reason(tmp_path):
    token_file = tmp_path / "token"
    new_token(token_file)
    backend = KubernetesBackend(
        image="img", api=RecordingCoreV1(phase="Pending", reason="ImagePullBackOff"), poll_s=0.01
    )
    backend.launch(1, Resources(), {c.ENV_TOKEN_FILE: str(token_file)})
    with pytest.raises(WorkerError, match=r"pods not running after 0s: textsql-run-\w+-0 \(ImagePullBackOff\)"):
        backend.wait(timeout=0.05)
    backend.stop()


# The declared interface (worker/backends/base.py), honoured by every backend -------------------------------

DECLARED = {name for name in dir(Backend) if not name.startswith("_")}


@pytest.fixture
def each_backend(request, cml_emulator, static_hosts_file, monkeypatch):
    """Every backend in BACKENDS, built as a user would (cml on the emulator, kubernetes on the stand-in)."""
    monkeypatch.setenv("CDSW_IP_ADDRESS", "10.1.0.4")
    monkeypatch.setenv("POD_IP", "10.2.0.4")
    options = {
        "local": {"sshd": False},
        "cml": {},
        "kubernetes": {"image": "img", "api": RecordingCoreV1(), "poll_s": 0.01},
        "static": {"hosts": static_hosts_file, "known_hosts": static_hosts_file.with_name("known_hosts")},
    }
    backend = make_backend(request.param, **options[request.param])
    yield backend
    backend.stop()


@pytest.fixture
def static_hosts_file(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3 slots=1\n")
    return hostfile


@pytest.mark.parametrize("each_backend", list(BACKENDS), indirect=True)
def test_every_backend_declares_how_it_provides_workers_and_honours_it(each_backend):
    backend = each_backend
    assert isinstance(backend, Backend) and backend.name in BACKENDS and isinstance(backend.attaches, bool)
    assert list(backend.pods) == []
    assert backend.ssh_port(2200, 2) == 2200 and 1 <= backend.ssh_port(None, 2) <= 65535
    if backend.attaches:
        # Host keys come from a known_hosts the user trusts; there is no agent to launch or address to give.
        assert backend.known_hosts is not None
        with pytest.raises(WorkerError, match="attaches to hosts that already run sshd; it launches nothing"):
            backend.launch(1, Resources(), {})
        with pytest.raises(WorkerError, match="asked for 5 workers but the static host list has 2"):
            backend.attach(5, 22)
    else:
        # Host keys arrive over the rendezvous; the run makes the client key.
        assert backend.known_hosts is None and backend.identity_file is None
        ipaddress.ip_address(backend.rendezvous_host())
        ipaddress.ip_address(backend.advertised_address())
        with pytest.raises(WorkerError, match="launches its workers; it has no existing hosts to attach to"):
            backend.attach(1, 22)
        backend.wait(0)  # nothing launched yet: nothing to wait for
        assert backend.failures() == {}
    backend.stop()
    backend.stop()  # idempotent, also before anything started
    with backend as entered:
        assert entered is backend


@pytest.mark.parametrize(
    "each_backend",
    [pytest.param("local", marks=pytest.mark.slow), pytest.param("cml", marks=pytest.mark.slow), "kubernetes"],
    indirect=True,
)
def test_every_launching_backend_lists_its_pods_until_it_stops_them(each_backend, tmp_path):
    """Agents pointed at a master that is not there keep retrying, so they stay up until stop()."""
    token_file = tmp_path / "token"
    new_token(token_file)
    env = {c.ENV_RENDEZVOUS: "127.0.0.1:1", c.ENV_TOKEN_FILE: str(token_file), c.ENV_SSHD: "0", c.ENV_DEADLINE: "60"}
    each_backend.workdir = tmp_path / "workers"
    handles = each_backend.launch(2, Resources(cpu=1, memory_gb=1), env)
    assert len(handles) == 2 and [h.pod for h in each_backend.pods] == [h.pod for h in handles]
    each_backend.wait(30)
    assert each_backend.failures() == {}
    each_backend.stop()
    assert list(each_backend.pods) == [] and each_backend.failures() == {}


def test_a_backend_that_lacks_what_it_declares_is_refused_when_defined():
    with pytest.raises(TypeError, match="HalfStatic declares attaches = True but does not override attach"):

        class HalfStatic(Backend):
            attaches = True

            def stop(self):
                pass

    with pytest.raises(
        TypeError, match="HalfLauncher declares attaches = False but does not override advertised_address"
    ):

        class HalfLauncher(Backend):
            def launch(self, count, resources, env):
                return []

            def stop(self):
                pass


class UsesRecorded:
    """Records which public attributes start_workers touches (the backend's own state is under ``_``)."""

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "_used").add(name)
        return object.__getattribute__(self, name)


class InProcessLauncher(UsesRecorded, Backend):
    """A launching backend whose "pods" register from this process, through the real rendezvous client."""

    name = "in-process"

    def __init__(self, host_key: str) -> None:
        self._used: set[str] = set()
        self._host_key = host_key
        self._sessions = []

    def advertised_address(self) -> str:
        return "127.0.0.1"

    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def launch(self, count, resources, env):
        port = int(env[c.ENV_SSH_PORT])
        for index in range(count):
            registration = Registration(
                address=f"127.0.0.{index + 2}",
                slots=1,
                hostname=f"fake-{index}",
                pod=f"fake-{index}",
                ssh_port=port,
                host_key=self._host_key,
            )
            key = self.pod_key(registration.pod)
            source = registration.address  # each pod connects from its own address
            self._sessions.append(register(env[c.ENV_RENDEZVOUS], key, registration, source=source))
        return [WorkerHandle(f"fake-{index}") for index in range(count)]

    def stop(self) -> None:
        for session in self._sessions:
            session.close()
        self._sessions = []


class InProcessAttacher(UsesRecorded, Backend):
    """An attaching backend whose hosts are described without ssh."""

    name = "in-process-hosts"
    attaches = True

    def __init__(self, host_key: str, known_hosts: Path) -> None:
        self._used: set[str] = set()
        self._host_key = host_key
        self.known_hosts = known_hosts

    def attach(self, count, ssh_port):
        return [
            Registration(
                address=f"127.0.0.{index + 2}",
                slots=2,
                hostname=f"host-{index}",
                pod=f"host-{index}",
                ssh_port=ssh_port,
                host_key=self._host_key,
            )
            for index in range(count)
        ]

    def stop(self) -> None:
        pass


@pytest.fixture
def host_key(tmp_path):
    return " ".join(generate_keypair(tmp_path / "host_key", "host").split()[:2])


def test_start_workers_launches_through_the_declared_interface_only(host_key, tmp_path):
    backend = InProcessLauncher(host_key)
    with start_workers(backend, 2, tmp_path / "run", timeout=20, ssh_port=2200) as cluster:
        assert cluster.hostfile.read_text() == "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"
        assert cluster.known_hosts.read_text() == f"[127.0.0.2]:2200 {host_key}\n[127.0.0.3]:2200 {host_key}\n"
        assert cluster.identity_file == tmp_path / "run" / c.IDENTITY_NAME and cluster.rendezvous[0] == "127.0.0.1"
    assert backend._used <= DECLARED, backend._used - DECLARED
    assert {
        "launch",
        "advertised_address",
        "rendezvous_host",
        "wait",
        "stop",
    } <= backend._used and "attach" not in backend._used


def test_start_workers_attaches_through_the_declared_interface_only(host_key, tmp_path):
    backend = InProcessAttacher(host_key, tmp_path / "trusted_known_hosts")
    with start_workers(backend, 2, tmp_path / "run", ssh_port=22) as cluster:
        assert cluster.hostfile.read_text() == "127.0.0.2 slots=2\n127.0.0.3 slots=2\n"
        assert cluster.known_hosts.read_text() == f"127.0.0.2 {host_key}\n127.0.0.3 {host_key}\n"
        assert cluster.identity_file is None and cluster.rendezvous == ("", 0)
    assert backend._used <= DECLARED, backend._used - DECLARED
    assert {"attach", "identity_file", "stop"} <= backend._used and not {"launch", "advertised_address"} & backend._used
    # Attached hosts have their own keys and sshd: no run token or client key is made for them.
    assert not (tmp_path / "run" / c.TOKEN_NAME).exists() and not (tmp_path / "run" / c.IDENTITY_NAME).exists()
