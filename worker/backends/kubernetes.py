"""``kubernetes``: worker pods through the official ``kubernetes`` client.

Per pod: a Secret holding that pod's own rendezvous key (mounted read-only as a file into that pod only;
the pod spec never holds the value; the run token stays with the master), and the pod running ``python -m worker.agent`` with the project's shared volume
mounted at the same path as on the master (DeepSpeed's pdsh launcher ``cd``s there on every worker),
``POD_IP`` and the pod name from the downward API, and ``nvidia.com/gpu`` limits. ``wait`` polls
until every pod is Running; ``replace`` deletes a lost pod (if it is still there) and creates one
like it (same spec and labels, name ``...-N-rK``); ``stop`` deletes the pods and the Secret; :func:`cleanup`
(``textsql workers cleanup``) deletes them by label when the kernel that started them died.

Pods run as the image's non-root user with no privilege escalation, no capabilities and the
runtime's default seccomp profile, for at most ``max_runtime_s``. The Secret is mounted 0440 with
the pod's ``fsGroup`` as its group, so that user can read it and nobody else; the agent is told
that group (``TEXTSQL_RENDEZVOUS_TOKEN_GROUP``) so its token check accepts exactly that.

No cluster runs in this project's tests: they check the Pod and Secret objects through the
client's own (validating) models, and run the backend against an emulated API server whose pods are
local agent processes (tests/fakes/kubernetes_api.py), not a live cluster.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import secrets
import time
from functools import partial
from pathlib import Path
from typing import Any

from worker import constants as c
from worker.backends.base import Backend, Resources, WorkerHandle
from worker.errors import WorkerError
from worker.network import route_address
from worker.rendezvous.token import pod_key, read_token

logger = logging.getLogger(__name__)

TOKEN_MOUNT = "/var/run/textsql"
# Every worker Pod and token Secret carries the app label and its run's label: cleanup finds them by these.
APP_LABELS = {"app.kubernetes.io/name": "textsql-worker"}
RUN_LABEL = "textsql/run"
APP_LABEL = ",".join(f"{key}={value}" for key, value in APP_LABELS.items())
_SECRET_KEY = "token"
_ENDED = {"Failed", "Succeeded"}
_TMP = "/tmp"  # an emptyDir: the pod's root filesystem is read-only


def _dns_name(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40] or "run"


def secret_name(pod: str) -> str:
    """The name of the Secret holding ``pod``'s key.

    :param pod: the pod's name.
    :rtype: str
    """
    return f"{pod}-key"


def _client() -> Any:
    from kubernetes import client

    return client


def connect() -> Any:
    """A CoreV1Api: in-cluster config inside a pod, else ~/.kube/config.

    :rtype: kubernetes.client.CoreV1Api
    """
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return _client().CoreV1Api()


class KubernetesBackend(Backend):
    """Worker pods in one namespace."""

    name = "kubernetes"
    shares_run_dir = True  # with project_claim the pods mount the run dir, read-write as the same user

    def __init__(
        self,
        image: str,
        namespace: str = "default",
        project_claim: str | None = None,
        project_path: str | None = None,
        service_account: str | None = None,
        node_selector: dict[str, str] | None = None,
        api: Any = None,
        poll_s: float = 2.0,
        user_id: int = 1000,
        group_id: int = 1000,
        max_runtime_s: int = 24 * 3600,
        home: str = "/home/textsql",
        ephemeral_storage_gb: float = 20.0,
        networking_api: Any = None,
    ) -> None:
        """
        :param image: the worker image (the session's image: python, deepspeed, sshd, pdsh).
        :param namespace: namespace for pods and the Secret.
        :param project_claim: PersistentVolumeClaim holding the project (None: the image has it).
        :param project_path: where the project is mounted (default: this process's working directory).
        :param service_account: pod service account.
        :param node_selector: pod node selector (e.g. a GPU node pool).
        :param api: a ``CoreV1Api`` (default: in-cluster config, else ~/.kube/config).
        :param poll_s: seconds between status polls.
        :param user_id: the image's non-root user (docker/Dockerfile: 1000).
        :param group_id: the pod's fsGroup: the group of the mounted token and of the pod's processes.
        :param max_runtime_s: ``activeDeadlineSeconds``: the pods end after this even if no one stops them.
        :param home: the image user's home directory (docker/Dockerfile: /home/textsql); its ``.cache`` is writable.
        :param ephemeral_storage_gb: each pod's limit on node-local disk (its writable volumes and logs).
        :param networking_api: a ``NetworkingV1Api`` for the run's NetworkPolicy (default: one on ``api``'s client).
        """
        self.image = image
        self.namespace = namespace
        self.project_claim = project_claim
        self.project_path = project_path or str(Path.cwd())
        self.service_account = service_account
        self.node_selector = node_selector
        self.poll_s = poll_s
        self.user_id = user_id
        self.group_id = group_id
        self.max_runtime_s = max_runtime_s
        self.home = home
        self.ephemeral_storage_gb = ephemeral_storage_gb
        self._api = api
        self._networking = networking_api
        self._policy: str | None = None
        self.run_id = ""
        self._pods: list[str] = []
        # The Pod objects created, by name: a replacement is a copy of the lost one under a new name.
        self._bodies: dict[str, Any] = {}
        self._replaced = 0
        # The Secrets created, one per pod (its key), including those of replaced pods.
        self._secrets: list[str] = []

    @property
    def api(self) -> Any:
        """The CoreV1Api, configured on first use.

        :rtype: kubernetes.client.CoreV1Api
        """
        if self._api is None:
            self._api = connect()
        return self._api

    @property
    def networking(self) -> Any:
        """The NetworkingV1Api, on the same client as :attr:`api` unless given.

        :rtype: kubernetes.client.NetworkingV1Api
        """
        if self._networking is None:
            # The stand-ins in the tests serve both APIs; a real CoreV1Api's client serves NetworkingV1Api too.
            api = self.api
            self._networking = (
                api if hasattr(api, "create_namespaced_network_policy") else _client().NetworkingV1Api(api.api_client)
            )
        return self._networking

    def advertised_address(self) -> str:
        return os.environ.get("POD_IP") or route_address(os.environ.get("KUBERNETES_SERVICE_HOST", "10.0.0.1"))

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(name) for name in self._pods]

    def _labels(self) -> dict[str, str]:
        return {**APP_LABELS, RUN_LABEL: self.run_id}

    def secret_spec(self, pod: str, key: str) -> Any:
        """The Secret holding one pod's rendezvous key, mounted by that pod only.

        :param pod: the pod's name.
        :param key: its key (:func:`~worker.rendezvous.token.pod_key`).
        :rtype: kubernetes.client.V1Secret
        """
        client = _client()
        return client.V1Secret(
            api_version="v1",
            kind="Secret",
            type="Opaque",
            string_data={_SECRET_KEY: key},
            metadata=client.V1ObjectMeta(name=secret_name(pod), labels=self._labels()),
        )

    def pod_spec(self, index: int, resources: Resources, env: dict[str, str]) -> Any:
        """The Pod for worker ``index``.

        :param index: the worker's index.
        :param resources: CPU, memory, GPUs.
        :param env: the agent's environment (any token is replaced by the pod's own Secret, mounted).
        :rtype: kubernetes.client.V1Pod
        """
        client = _client()
        name = f"textsql-{self.run_id}-{index}"
        plain = {
            **env,
            c.ENV_TOKEN_FILE: f"{TOKEN_MOUNT}/{_SECRET_KEY}",
            c.ENV_TOKEN_GROUP: str(self.group_id),
            c.ENV_SLOTS: str(max(1, resources.gpus)),
            c.ENV_SSHD_KEYS_DIR: f"{_TMP}/textsql-sshd",  # the home directory is read-only
        }
        plain.pop(c.ENV_TOKEN, None)
        variables = [client.V1EnvVar(name=key, value=value) for key, value in sorted(plain.items())]
        variables += [
            client.V1EnvVar(
                name="POD_IP",
                value_from=client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path="status.podIP")),
            ),
            client.V1EnvVar(
                name=c.ENV_POD,
                value_from=client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path="metadata.name")),
            ),
        ]
        limits = {
            "cpu": str(resources.cpu),
            "memory": f"{resources.memory_gb:g}Gi",
            "ephemeral-storage": f"{self.ephemeral_storage_gb:g}Gi",
        }
        if resources.gpus:
            limits["nvidia.com/gpu"] = str(resources.gpus)
        mounts = [
            client.V1VolumeMount(name="token", mount_path=TOKEN_MOUNT, read_only=True),
            client.V1VolumeMount(name="shm", mount_path="/dev/shm"),
            # The root filesystem is read-only: the agent's and sshd's files go to /tmp, the ranks' caches
            # (torch extensions, Hugging Face) to ~/.cache.
            client.V1VolumeMount(name="tmp", mount_path=_TMP),
            client.V1VolumeMount(name="cache", mount_path=f"{self.home}/.cache"),
        ]
        # 0440: with an fsGroup the kubelet makes the files group-readable anyway; say so, and check it.
        volumes = [
            client.V1Volume(
                name="token",
                secret=client.V1SecretVolumeSource(secret_name=secret_name(name), default_mode=0o440),
            ),
            # NCCL's shared-memory transport needs more than the runtime's 64 MB /dev/shm.
            client.V1Volume(
                name="shm",
                empty_dir=client.V1EmptyDirVolumeSource(
                    medium="Memory", size_limit=f"{max(1.0, resources.memory_gb / 2):g}Gi"
                ),
            ),
            client.V1Volume(name="tmp", empty_dir=client.V1EmptyDirVolumeSource(size_limit="1Gi")),
            client.V1Volume(
                name="cache",
                empty_dir=client.V1EmptyDirVolumeSource(size_limit=f"{max(1.0, self.ephemeral_storage_gb / 2):g}Gi"),
            ),
        ]
        if self.project_claim:
            mounts.append(client.V1VolumeMount(name="project", mount_path=self.project_path))
            volumes.append(
                client.V1Volume(
                    name="project",
                    persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(claim_name=self.project_claim),
                )
            )
        seccomp = client.V1SeccompProfile(type="RuntimeDefault")
        container = client.V1Container(
            # args, not command: the image's entrypoint (tini) stays pid 1 and reaps sshd's children.
            name="agent",
            image=self.image,
            args=["python", "-m", "worker.agent"],
            env=variables,
            working_dir=self.project_path,
            volume_mounts=mounts,
            resources=client.V1ResourceRequirements(requests=dict(limits), limits=limits),
            security_context=client.V1SecurityContext(
                run_as_non_root=True,
                allow_privilege_escalation=False,
                read_only_root_filesystem=True,
                capabilities=client.V1Capabilities(drop=["ALL"]),
                seccomp_profile=seccomp,
            ),
        )
        return client.V1Pod(
            api_version="v1",
            kind="Pod",
            metadata=client.V1ObjectMeta(name=name, namespace=self.namespace, labels=self._labels()),
            spec=client.V1PodSpec(
                containers=[container],
                volumes=volumes,
                restart_policy="Never",
                service_account_name=self.service_account,
                node_selector=self.node_selector,
                automount_service_account_token=False,
                active_deadline_seconds=self.max_runtime_s,
                security_context=client.V1PodSecurityContext(
                    run_as_non_root=True,
                    run_as_user=self.user_id,
                    run_as_group=self.group_id,
                    fs_group=self.group_id,
                    seccomp_profile=seccomp,
                ),
            ),
        )

    def network_policy(self, master_address: str, ssh_port: int) -> Any:
        """The run's NetworkPolicy: its pods admit sshd's port from the master alone, and every other port
        (the ranks' torch.distributed store, gloo and NCCL) from the run's own pods; nothing else comes in.

        :param master_address: the master's pod IP (where pdsh and the probes come from).
        :param ssh_port: the workers' sshd port.
        :rtype: kubernetes.client.V1NetworkPolicy
        """
        client = _client()
        prefix = 128 if ":" in master_address else 32
        ranges = [(first, last) for first, last in ((1, ssh_port - 1), (ssh_port + 1, 65535)) if first <= last]
        run_pods = client.V1NetworkPolicyPeer(pod_selector=client.V1LabelSelector(match_labels=self._labels()))
        return client.V1NetworkPolicy(
            api_version="networking.k8s.io/v1",
            kind="NetworkPolicy",
            metadata=client.V1ObjectMeta(
                name=f"textsql-{self.run_id}-workers", namespace=self.namespace, labels=self._labels()
            ),
            spec=client.V1NetworkPolicySpec(
                pod_selector=client.V1LabelSelector(match_labels=self._labels()),
                policy_types=["Ingress"],
                ingress=[
                    client.V1NetworkPolicyIngressRule(
                        _from=[
                            client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=f"{master_address}/{prefix}"))
                        ],
                        ports=[client.V1NetworkPolicyPort(protocol="TCP", port=ssh_port)],
                    ),
                    client.V1NetworkPolicyIngressRule(
                        _from=[run_pods],
                        ports=[
                            client.V1NetworkPolicyPort(protocol="TCP", port=first, end_port=last)
                            for first, last in ranges
                        ],
                    ),
                ],
            ),
        )

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        run_name = self.workdir.parent.name if self.workdir else "run"
        self.run_id = self.run_id or f"{_dns_name(run_name)}-{secrets.token_hex(3)}"
        if self.pod_key is None:  # called with the run's token rather than by start_workers
            self.pod_key = partial(pod_key, env.get(c.ENV_TOKEN) or read_token(Path(env[c.ENV_TOKEN_FILE])))
        if self._policy is None and env.get(c.ENV_RENDEZVOUS):
            master = env[c.ENV_RENDEZVOUS].rpartition(":")[0].strip("[]")
            policy = self.network_policy(master, int(env.get(c.ENV_SSH_PORT, c.DEFAULT_SSH_PORT)))
            self.networking.create_namespaced_network_policy(self.namespace, policy)
            self._policy = policy.metadata.name
        start = len(self._pods)
        for index in range(start, start + count):
            pod = self.pod_spec(index, resources, env)
            self._create(pod)
            self._pods.append(pod.metadata.name)
        logger.info("created %d pods in namespace %s (run %s)", count, self.namespace, self.run_id)
        return self.pods[start:]

    def _create(self, pod: Any) -> None:
        """Create ``pod``'s Secret (its own key), then the pod that mounts it."""
        name = pod.metadata.name
        assert self.pod_key is not None, "start_workers gives the backend its pod_key before any launch"
        self.api.create_namespaced_secret(self.namespace, self.secret_spec(name, self.pod_key(name)))
        self._secrets.append(secret_name(name))
        self.api.create_namespaced_pod(self.namespace, pod)
        self._bodies[name] = pod

    def _phases(self) -> dict[str, tuple[str, str]]:
        listed = self.api.list_namespaced_pod(self.namespace, label_selector=f"{RUN_LABEL}={self.run_id}")
        phases = {}
        for pod in listed.items:
            if pod.metadata.name not in self._pods:
                continue  # a replaced pod still terminating is no longer ours to wait for or report
            waiting = [
                s.state.waiting.reason
                for s in (pod.status.container_statuses or [])
                if s.state and s.state.waiting and s.state.waiting.reason
            ]
            phases[pod.metadata.name] = (pod.status.phase or "Unknown", ", ".join(waiting))
        return phases

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            phases = self._phases()
            ended = {name: phase for name, (phase, _) in phases.items() if phase in _ENDED}
            if ended:
                raise WorkerError(f"pods ended before registering: {ended}; see kubectl logs -n {self.namespace}")
            pending = {}
            for name in self._pods:
                phase, reason = phases.get(name, ("Missing", ""))
                if phase != "Running":
                    pending[name] = reason or phase
            if not pending:
                return
            if time.monotonic() >= deadline:
                described = ", ".join(f"{name} ({state})" for name, state in sorted(pending.items()))
                raise WorkerError(
                    f"pods not running after {timeout:.0f}s: {described}; check image, quota and GPU nodes"
                )
            time.sleep(self.poll_s)

    def failures(self) -> dict[str, str]:
        return {name: f"ended with phase {phase}" for name, (phase, _) in self._phases().items() if phase in _ENDED}

    def replace(self, pod: str, timeout: float) -> WorkerHandle:
        """Delete ``pod`` if it is still there and create a copy of it named ``textsql-RUN-N-rK``.

        The copy has the lost pod's spec, labels (so :func:`cleanup` finds it) and owner references;
        Kubernetes gives it a new IP, so the replacement registers at a new address with a new host key.

        :param pod: the lost worker's pod name.
        :param timeout: seconds the old pod's agent gets to stop (at most ``STOP_GRACE_S``); the caller
            waits for the new pod to run and register.
        :rtype: WorkerHandle
        :raises WorkerError: if ``pod`` is not one of this backend's pods.
        """
        if pod not in self._bodies:
            raise WorkerError(f"no pod {pod!r} of this run to replace; pods: {', '.join(self._pods) or 'none'}")
        self._delete_pod(pod, grace_s=max(1.0, min(c.STOP_GRACE_S, timeout)))
        body = copy.deepcopy(self._bodies.pop(pod))
        self._replaced += 1
        # textsql-RUN-N, or textsql-RUN-N-rJ when a replacement is lost in turn: the new one is textsql-RUN-N-rK.
        body.metadata.name = f"{re.sub(r'-r[0-9]+$', '', pod)}-r{self._replaced}"
        body.metadata.annotations = {**(body.metadata.annotations or {}), "textsql/replaces": pod}
        key_volume = next(volume for volume in body.spec.volumes if volume.name == "token")
        key_volume.secret.secret_name = secret_name(body.metadata.name)
        self._create(body)
        self._pods[self._pods.index(pod)] = body.metadata.name
        logger.info("replaced pod %s with %s in namespace %s", pod, body.metadata.name, self.namespace)
        return WorkerHandle(body.metadata.name, f"replaces {pod}")

    def _delete_pod(self, name: str, grace_s: float = c.STOP_GRACE_S) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.delete_namespaced_pod(name, self.namespace, grace_period_seconds=int(grace_s))
        except ApiException as error:
            if error.status != 404:  # already gone is what we wanted
                logger.warning(
                    "could not delete pod %s: %s; `textsql workers cleanup` deletes it by its labels",
                    name,
                    error.reason,
                )

    def stop(self) -> None:
        from kubernetes.client.exceptions import ApiException

        for name in self._pods:
            self._delete_pod(name)
        for name in self._secrets:
            try:
                self.api.delete_namespaced_secret(name, self.namespace)
            except ApiException as error:
                if error.status != 404:
                    logger.warning("could not delete secret %s: %s", name, error.reason)
        if self._policy:
            try:
                self.networking.delete_namespaced_network_policy(self._policy, self.namespace)
            except ApiException as error:
                if error.status != 404:
                    logger.warning("could not delete network policy %s: %s", self._policy, error.reason)
        if self._pods:
            logger.info("deleted %d pods in namespace %s", len(self._pods), self.namespace)
        self._pods, self._bodies, self._secrets, self._policy = [], {}, [], None


def cleanup(api: Any, namespace: str, run_id: str | None = None) -> tuple[list[str], list[str]]:
    """Delete the worker Pods, key Secrets and NetworkPolicy of one run (or of every run) by their labels.

    For runs whose kernel died before ``stop``: the labels are all that is left to find them by.

    :param api: a ``CoreV1Api``.
    :param namespace: the namespace the workers ran in.
    :param run_id: the run's id (the ``textsql/run`` label; None: every textsql run in the namespace).
    :rtype: tuple[list[str], list[str]]
    :returns: names of the deleted Pods and Secrets.
    """
    selector = APP_LABEL + (f",{RUN_LABEL}={run_id}" if run_id else "")
    pod_names = [pod.metadata.name for pod in api.list_namespaced_pod(namespace, label_selector=selector).items]
    secret_names = [
        secret.metadata.name for secret in api.list_namespaced_secret(namespace, label_selector=selector).items
    ]
    for name in pod_names:
        api.delete_namespaced_pod(name, namespace, grace_period_seconds=int(c.STOP_GRACE_S))
    for name in secret_names:
        api.delete_namespaced_secret(name, namespace)
    # The stand-ins in the tests serve both APIs; a real CoreV1Api's client serves NetworkingV1Api too.
    networking = api if hasattr(api, "list_namespaced_network_policy") else _client().NetworkingV1Api(api.api_client)
    policies = [
        p.metadata.name for p in networking.list_namespaced_network_policy(namespace, label_selector=selector).items
    ]
    for name in policies:
        networking.delete_namespaced_network_policy(name, namespace)
    logger.info(
        "deleted %d pods, %d secrets and %d network policies labelled %s in namespace %s",
        len(pod_names),
        len(secret_names),
        len(policies),
        selector,
        namespace,
    )
    return pod_names, secret_names
