"""The pod's own user reads the token Secret as the kubelet mounts it for our pod spec, and nobody else may.

No kubelet runs here: the mount is laid out the way the kubelet's atomic writer and fsGroup ownership
lay it out (a timestamped directory, a ``..data`` symlink to it, one symlink per key through
``..data``; files get the Secret's defaultMode plus group read, group = fsGroup), then read by a
process running with the pod's uid and supplementary groups.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
import tempfile
from pathlib import Path

import pytest
from fakes.kubernetes_api import RecordingCoreV1, RecordingNetworkingV1

from worker import constants as c
from worker.backends import Resources
from worker.backends.kubernetes import KubernetesBackend
from worker.backends.kubernetes_manifests import TOKEN_MOUNT
from worker.backends.kubernetes_options import KubernetesOptions
from worker.errors import RendezvousError, WorkerError
from worker.rendezvous.token import new_token, read_token


def kubelet_secret_mount(root: Path, pod, token: str) -> Path:
    """The token volume of ``pod`` under ``root``, laid out as the kubelet does; returns the key's path."""
    spec = pod.spec
    volume = next(v for v in spec.volumes if v.secret)
    fs_group = spec.security_context.fs_group if spec.security_context else None
    mount = root / TOKEN_MOUNT.lstrip("/")
    stamped = mount / "..2025_01_31_12_00_00.123456789"
    stamped.mkdir(parents=True)
    key = stamped / "token"
    key.write_text(token)
    mode = volume.secret.default_mode
    if fs_group is not None:  # SetVolumeOwnership: group = fsGroup, read-only volume gets group read
        for path in (mount, stamped, key):
            os.chown(path, 0, fs_group)
        mode |= 0o440
        os.chmod(stamped, 0o2755)
    os.chmod(key, mode)
    (mount / "..data").symlink_to(stamped.name)
    (mount / "token").symlink_to("..data/token")
    return mount / "token"


def pod_env(pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}


@pytest.fixture
def mounted(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("laying out the kubelet's ownership needs root")
    backend = KubernetesBackend(KubernetesOptions(image="img"), api=object())
    backend.run_id = "demo-abc123"
    pod = backend.pod_spec(0, Resources(), {c.ENV_TOKEN_FILE: "/x"})
    token = secrets.token_urlsafe(32)
    # Outside pytest's 0700 tmp dirs, so the pod's uid can reach it.
    root = Path(tempfile.mkdtemp(prefix="kubelet-"))
    os.chmod(root, 0o755)
    try:
        yield pod, kubelet_secret_mount(root, pod, token), token
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def read_as(uid: int, gid: int, groups: list[int], path: Path, group: int) -> str:
    """read_token in a child process that has dropped to ``uid``/``gid``/``groups``, as the agent runs in the pod."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and never returns
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.write(writer, ("ok " + read_token(path, group)).encode())
        except BaseException as error:  # noqa: BLE001 - the forked child reports every failure through the pipe
            os.write(writer, f"error {error}".encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        answer = pipe.read()
    os.waitpid(child, 0)
    return answer


def test_the_pods_user_reads_the_mounted_token_with_the_agents_check(mounted):
    pod, path, token = mounted
    security, env = pod.spec.security_context, pod_env(pod)
    answer = read_as(
        security.run_as_user, security.run_as_group, [security.fs_group], path, int(env[c.ENV_TOKEN_GROUP])
    )
    assert answer == f"ok {token}"


def test_a_group_readable_token_is_refused_for_any_other_group(mounted):
    pod, path, _token = mounted
    assert oct(path.stat().st_mode & 0o777) == "0o440"
    with pytest.raises(RendezvousError, match="readable by others"):
        read_token(path)
    with pytest.raises(RendezvousError, match="readable by others"):
        read_token(path, group=pod.spec.security_context.fs_group + 1)
    os.chmod(path.resolve(), 0o444)
    with pytest.raises(RendezvousError, match="readable by others"):
        read_token(path, group=pod.spec.security_context.fs_group)


# Issue 37, hole 3 and weak point 6: what a compromised worker pod can write and reach -------------------


def writable_mounts(pod) -> list[Path]:
    """Where a pod's container can write shared storage: its read-write mounts of a PersistentVolumeClaim."""
    claims = {v.name for v in pod.spec.volumes if v.persistent_volume_claim is not None}
    return [Path(m.mount_path) for m in pod.spec.containers[0].volume_mounts if m.name in claims and not m.read_only]


@pytest.fixture
def project(tmp_path):
    """A project on the shared volume as the master sees it: the code, and a run directory start_workers made."""
    root = tmp_path / "project"
    for package in ("textsql", "worker"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "runs" / "r1").mkdir(parents=True)
    for name in ("notebooks", ".git", "cml", "scripts", ".venv/lib/python3.11/site-packages"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for held in ("tools/setup.sh", "venv/pyvenv.cfg", "explore/analysis.ipynb"):
        (root / "runs" / held).parent.mkdir(parents=True)
        (root / "runs" / held).write_text("")
    return root


def test_a_worker_pod_can_write_its_run_directory_and_no_code_the_master_imports(project):
    backend = KubernetesBackend(
        KubernetesOptions(image="img", project_claim="pvc", project_path=str(project)), api=object()
    )
    backend.run_id, backend.workdir = "demo-abc123", project / "runs" / "r1" / "workers"
    pod = backend.pod_spec(0, Resources(), {c.ENV_TOKEN_FILE: "/x"})
    assert writable_mounts(pod) == [project / "runs" / "r1"]
    for code in ("textsql/__init__.py", "worker/agent.py", "notebooks/02_train_distributed.ipynb", "pyproject.toml"):
        assert not any((project / code).is_relative_to(mount) for mount in writable_mounts(pod)), code


@pytest.mark.parametrize(
    "run_dir, refused",
    [
        (".", "is not inside the project volume"),  # the whole project, code and all
        ("../elsewhere", "is not inside the project volume"),  # not on the volume: ranks could write nothing
        ("textsql/runs/r1", "lies in the Python package '.*/project/textsql', code the master imports"),
        ("worker", "lies in the Python package '.*/project/worker'"),
        # Not a package, yet what the master or a person runs: only a directory of its own under runs/ is given.
        ("notebooks", "is not under the project's runs/ directory"),  # notebook 02's run_dir="." from notebooks/
        (".venv/lib/python3.11/site-packages", "is not under the project's runs/ directory"),
        (".git", "is not under the project's runs/ directory"),
        ("cml", "is not under the project's runs/ directory"),
        ("scripts", "is not under the project's runs/ directory"),
        ("runs", "is not under the project's runs/ directory"),  # every run's directory at once
        ("runs/tools", "holds 'setup.sh', which the master or a person may run"),
        ("runs/venv", "holds 'pyvenv.cfg', which the master or a person may run"),
        ("runs/explore", "holds 'analysis.ipynb', which the master or a person may run"),
    ],
)
def test_a_run_directory_that_would_open_the_masters_code_to_workers_is_refused(project, run_dir, refused):
    backend = KubernetesBackend(
        KubernetesOptions(image="img", project_claim="pvc", project_path=str(project)), api=object()
    )
    backend.run_id, backend.workdir = "demo-abc123", project / run_dir / "workers"
    with pytest.raises(WorkerError, match=rf"run directory .*{refused}.*; pass a run_dir .*/project/runs/NAME"):
        backend.pod_spec(0, Resources(), {c.ENV_TOKEN_FILE: "/x"})


def test_a_launch_refused_for_its_run_directory_creates_nothing(project):
    core, networking = RecordingCoreV1(), RecordingNetworkingV1()
    options = KubernetesOptions(image="img", project_claim="pvc", project_path=str(project))
    backend = KubernetesBackend(options, api=core, networking_api=networking)
    backend.workdir = project / "workers"
    env = {c.ENV_TOKEN: "t" * 43, c.ENV_RENDEZVOUS: "10.0.0.4:29400"}
    with pytest.raises(WorkerError, match="is not inside the project volume"):
        backend.launch(2, Resources(), env)
    assert core.pods == {} and core.secrets == {} and networking.policies == {}


def admits(rules: list[dict], peer_key: str, protocol: str, port: int, ip: str | None = None, pod=None) -> bool:
    """Whether NetworkPolicy ``rules`` (serialized) admit a connection, by the API's own semantics.

    The other end is an address (``ip``) or a pod, given as ``(namespace, labels)``; the policy lives in "ml".
    """

    def peer_matches(peer: dict) -> bool:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            return ip is not None and (
                ipaddress.ip_address(ip) in ipaddress.ip_network(block["cidr"])
                and not any(ipaddress.ip_address(ip) in ipaddress.ip_network(e) for e in block.get("except", []))
            )
        if pod is None:
            return False
        namespace, labels = pod
        if "namespaceSelector" in peer:
            wanted = peer["namespaceSelector"].get("matchLabels", {})
            if not wanted.items() <= {"kubernetes.io/metadata.name": namespace}.items():
                return False
        elif namespace != "ml":
            return False
        return peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()

    def port_matches(spec: dict) -> bool:
        return spec["protocol"] == protocol and spec["port"] <= port <= spec.get("endPort", spec["port"])

    # A rule without peers admits every peer; one without ports, every port.
    return any(
        (not rule.get(peer_key) or any(peer_matches(peer) for peer in rule[peer_key]))
        and (not rule.get("ports") or any(port_matches(spec) for spec in rule["ports"]))
        for rule in rules
    )


RUN = {"app.kubernetes.io/name": "textsql-worker", "textsql/run": "demo-abc123"}
DNS = ("kube-system", {"k8s-app": "kube-dns"})


def test_worker_pods_reach_the_rendezvous_each_other_and_dns_and_nothing_else(tmp_path):
    from kubernetes.client import ApiClient

    token_file = tmp_path / "token"
    new_token(token_file)
    networking = RecordingNetworkingV1()
    backend = KubernetesBackend(
        KubernetesOptions(image="img", namespace="ml"), api=RecordingCoreV1(), networking_api=networking
    )
    backend.run_id = "demo-abc123"
    env = {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:29400", c.ENV_SSH_PORT: "2222"}
    backend.launch(2, Resources(), env)
    (policy,) = [ApiClient().sanitize_for_serialization(body) for body in networking.policies.values()]
    assert policy["spec"]["podSelector"] == {"matchLabels": RUN}
    egress = policy["spec"].get("egress") or [{}]  # no egress rules: without "Egress" among its types, all of it

    def reaches(protocol: str, port: int, ip: str | None = None, pod=None) -> bool:
        return admits(egress, "to", protocol, port, ip=ip, pod=pod)

    assert reaches("TCP", 29400, ip="10.0.0.4")  # the master's rendezvous
    for port in (22, 2222, 6006, 8888, 29401):  # its ssh, TensorBoard, JupyterLab, anything else
        assert not reaches("TCP", port, ip="10.0.0.4"), port
    # Each other: torch.distributed's store (29500), gloo's and NCCL's ephemeral ports; not each other's sshd.
    for port in (c.DEFAULT_RENDEZVOUS_PORT + 100, 29500, 40000, 65535):
        assert reaches("TCP", port, pod=("ml", RUN)), port
    assert not reaches("TCP", 2222, pod=("ml", RUN))
    assert reaches("UDP", 53, pod=DNS) and reaches("TCP", 53, pod=DNS)
    assert not reaches("TCP", 443, pod=DNS)
    # Not the cloud's metadata endpoint, another namespace, another run's pods, the internet or its DNS.
    assert not reaches("TCP", 80, ip="169.254.169.254")
    assert not reaches("TCP", 29500, pod=("other", RUN))
    assert not reaches("TCP", 29500, pod=("ml", {**RUN, "textsql/run": "another-run"}))
    assert not reaches("TCP", 443, ip="140.82.112.3") and not reaches("UDP", 53, ip="8.8.8.8")
