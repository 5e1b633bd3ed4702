"""Stand-ins for a Kubernetes API server, for tests on a machine where no cluster runs.

Each stands in for one of the official client's API classes and has only methods of that class, with its
parameter names, return types and exceptions (``NotFoundException``, a 404 ``ApiException``), so the
backend calls them exactly as it calls the real ones (tests/test_backends.py holds them to the pinned
client's signatures). ``RecordingCoreV1`` (``CoreV1Api``) keeps the objects it is given and reports one
set phase for every pod: enough to check the objects and the calls. ``RecordingNetworkingV1``
(``NetworkingV1Api``) keeps NetworkPolicies; nothing enforces them (no network namespaces here: the
policy's effect is checked on the object, tests/test_worker_kubernetes.py). ``KubeletCoreV1`` is an
EMULATOR of an API server with a kubelet behind it: each Pod it is given runs its container's ``args``
as a local process, with what the kubelet would provide emulated (the image's variables, ``fakes.image_env``,
then the Pod's; a new loopback address as the pod IP, the downward-API fields, the Secret volume as files), so the backend's real agents, sshd and rendezvous
run against it. What it does not do: namespaces (one for all), scheduling, image pulls
(``image_pull_fails`` leaves new pods Pending the way a failed pull does), user and group ids
(test_worker_kubernetes.py checks the mount's ownership as root), read-only and subPath mounts (the
project is the same directory here), resource limits, network namespaces, ``activeDeadlineSeconds``.
``RoleBound`` puts the API server's RBAC authorizer in front of any of them: a call that a Role's rules do not
grant gets the 403 a cluster answers, the call's verb, resource and API group read from the pinned client's own
request (its HTTP method and path), as the API server reads them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from fakes.image_env import image_environment
from kubernetes import client
from kubernetes.client.exceptions import ForbiddenException, NotFoundException

from worker.files import atomic_write


def selected(body, label_selector) -> bool:
    """Whether ``body``'s labels match an equality ``label_selector`` (``a=b,c=d``), as the API server matches."""
    wanted = dict(term.split("=", 1) for term in label_selector.split(",")) if label_selector else {}
    return wanted.items() <= (body.metadata.labels or {}).items()


def not_found(kind: str, name: str) -> NotFoundException:
    """What the client raises for a 404."""
    return NotFoundException(status=404, reason=f'{kind} "{name}" not found')


class RecordingNetworkingV1:
    """Stand-in for ``NetworkingV1Api``: keeps the NetworkPolicies it is given (see the module docstring)."""

    def __init__(self):
        self.policies = {}

    def create_namespaced_network_policy(self, namespace, body):
        self.policies[body.metadata.name] = body
        return body

    def list_namespaced_network_policy(self, namespace, label_selector=None):
        return client.V1NetworkPolicyList(
            items=[body for body in self.policies.values() if selected(body, label_selector)]
        )

    def delete_namespaced_network_policy(self, name, namespace):
        if self.policies.pop(name, None) is None:
            raise not_found("networkpolicies", name)
        return client.V1Status(status="Success")


class RecordingCoreV1:
    """Stand-in for ``CoreV1Api`` (no API server runs here): keeps created objects, reports a set phase."""

    def __init__(self, phase="Running", reason=None):
        self.phase, self.reason = phase, reason
        self.pods, self.secrets = {}, {}

    selected = staticmethod(selected)

    def create_namespaced_secret(self, namespace, body):
        self.secrets[body.metadata.name] = body
        return body

    def create_namespaced_pod(self, namespace, body):
        self.pods[body.metadata.name] = body
        return body

    def list_namespaced_secret(self, namespace, label_selector=None):
        return client.V1SecretList(items=[body for body in self.secrets.values() if selected(body, label_selector)])

    def status_of(self, name):
        """(phase, waiting reason or None) of pod ``name``."""
        return self.phase, self.reason

    def list_namespaced_pod(self, namespace, label_selector=None):
        items = []
        for name, pod in self.pods.items():
            if not selected(pod, label_selector):
                continue
            phase, reason = self.status_of(name)
            waiting = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason=reason)) if reason else None
            statuses = (
                [
                    client.V1ContainerStatus(
                        name="agent", image="i", image_id="", ready=False, restart_count=0, state=waiting
                    )
                ]
                if waiting
                else None
            )
            items.append(
                client.V1Pod(
                    metadata=client.V1ObjectMeta(name=name, labels=pod.metadata.labels),
                    status=client.V1PodStatus(phase=phase, container_statuses=statuses),
                )
            )
        return client.V1PodList(items=items)

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds=None):
        if name not in self.pods:
            raise not_found("pods", name)
        return self.pods.pop(name)

    def delete_namespaced_secret(self, name, namespace):
        if self.secrets.pop(name, None) is None:
            raise not_found("secrets", name)
        return client.V1Status(status="Success")


class KubeletCoreV1(RecordingCoreV1):
    """EMULATOR: an API server whose pods run as local processes (see the module docstring).

    ``processes`` maps each running pod to its container's process, as the node sees it; ``ips`` maps
    each pod to its address (127.0.0.2, 127.0.0.3, ...: a new one per pod, as a cluster gives a new
    pod a new IP). Logs go to ``root/POD.log``.
    """

    def __init__(self, root: Path):
        super().__init__()
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.image_pull_fails = False
        self.processes: dict[str, subprocess.Popen] = {}
        self.ips: dict[str, str] = {}
        self._addresses = itertools.count(2)

    def create_namespaced_pod(self, namespace, body):
        super().create_namespaced_pod(namespace, body)
        if not self.image_pull_fails:
            self._run(body)

    def status_of(self, name):
        process = self.processes.get(name)
        if process is None:
            return "Pending", "ImagePullBackOff"
        code = process.poll()
        if code is None:
            return "Running", None
        return ("Succeeded" if code == 0 else "Failed"), None

    def _mount_secrets(self, body) -> dict[str, Path]:
        """Each Secret volume's keys as 0600 files under root/POD/VOLUME: mount path -> that directory."""
        mounts = {}
        container = body.spec.containers[0]
        for volume in body.spec.volumes:
            if volume.secret is None:
                continue  # the project volume is the same path here; /dev/shm is the machine's
            directory = self.root / body.metadata.name / volume.name
            directory.mkdir(parents=True)
            for key, value in (self.secrets[volume.secret.secret_name].string_data or {}).items():
                atomic_write(directory / key, value, mode=0o600)
            mount = next(m for m in container.volume_mounts if m.name == volume.name)
            mounts[mount.mount_path] = directory
        return mounts

    def _run(self, body) -> None:
        name = body.metadata.name
        self.ips[name] = f"127.0.0.{next(self._addresses)}"
        fields = {"status.podIP": self.ips[name], "metadata.name": name}
        mounts = self._mount_secrets(body)
        container = body.spec.containers[0]
        env = image_environment()  # the image's variables, never the session's (fakes.image_env)
        for variable in container.env:
            value = variable.value if variable.value_from is None else fields[variable.value_from.field_ref.field_path]
            for mount_path, directory in mounts.items():
                if value.startswith(mount_path + "/"):
                    value = str(directory) + value[len(mount_path) :]
            env[variable.name] = value
        # The image's python is this interpreter; tini, the image's entrypoint, is not needed here.
        command = [sys.executable if arg == "python" else arg for arg in container.args]
        with open(self.root / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                command,
                env=env,
                cwd=container.working_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds=None):
        body = super().delete_namespaced_pod(name, namespace, grace_period_seconds=grace_period_seconds)
        process = self.processes.pop(name, None)
        if process is not None and process.poll() is None:
            process.terminate()  # the kubelet's SIGTERM, then SIGKILL to the container after the grace period
            try:
                process.wait(timeout=30 if grace_period_seconds is None else grace_period_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return body

    def close(self) -> None:
        """Delete every pod still there (a test's teardown)."""
        for name in list(self.pods):
            self.delete_namespaced_pod(name, "default", grace_period_seconds=5)


# A client method that is a request to the API server (the rest are helpers such as api_client).
_REQUEST = re.compile(r"^(create|read|list|watch|replace|patch|delete|deletecollection|connect)_\w+$")


@functools.cache
def authorization(api_class: type, method: str) -> tuple[str, str, str]:
    """(API group, resource, verb) the API server authorizes a call of ``api_class.method`` as.

    Read from the pinned client's request for it (``_METHOD_serialize``: the HTTP method and the resource path),
    resolved as the API server's request info does: POST is create, GET of a named object get and of a collection
    list, DELETE of a named object delete and of a collection deletecollection, PUT update, PATCH patch.
    """
    source = inspect.getsource(getattr(api_class, f"_{method}_serialize"))
    http = re.search(r"method='(\w+)'", source).group(1)
    parts = re.search(r"resource_path='([^']+)'", source).group(1).strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource = "/".join(rest[0:3:2])  # pods, or pods/log for a subresource
    named = len(rest) > 1
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
    verb = verbs.get(http) or {"GET": ("get", "list"), "DELETE": ("delete", "deletecollection")}[http][not named]
    return group, resource, verb


def role_rules(path: Path) -> tuple[str, list[dict]]:
    """The namespace and rules of the one Role in the manifests at ``path``."""
    (role,) = [document for document in yaml.safe_load_all(path.read_text()) if document["kind"] == "Role"]
    return role["metadata"]["namespace"], role["rules"]


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    """Every (API group, resource, verb) ``rules`` grant."""
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


class RoleBound:
    """The API server's RBAC authorizer in front of a stand-in for ``api_class``: each request the Role's rules
    (``role_rules``) do not grant in its namespace is refused with the client's 403 (``ForbiddenException``);
    ``requests`` records each (API group, resource, verb) that was let through."""

    def __init__(self, api, api_class: type, namespace: str, rules: list[dict], account: str = "textsql-notebook"):
        self.api, self.api_class, self.namespace = api, api_class, namespace
        self.granted, self.account = granted(rules), account
        self.requests: set[tuple[str, str, str]] = set()

    def __getattr__(self, name):
        method = getattr(self.api, name)
        if not _REQUEST.match(name):
            return method
        request = authorization(self.api_class, name)
        signature = inspect.signature(getattr(self.api_class, name))

        def authorized(*args, **kwargs):
            namespace = signature.bind(self, *args, **kwargs).arguments.get("namespace")
            group, resource, verb = request
            if request not in self.granted or namespace != self.namespace:
                raise ForbiddenException(
                    status=403,
                    reason=f'{resource} is forbidden: User "system:serviceaccount:{self.namespace}:{self.account}" '
                    f'cannot {verb} resource "{resource}" in API group "{group}" in the namespace "{namespace}"',
                )
            self.requests.add(request)
            return method(*args, **kwargs)

        return authorized
