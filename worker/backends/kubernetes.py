"""``kubernetes``: worker pods through the official ``kubernetes`` client.

Per run a NetworkPolicy (:mod:`~worker.backends.kubernetes_policy`), per pod a Secret holding that pod's
own rendezvous key and the pod running ``python -m worker.agent`` (:mod:`~worker.backends.kubernetes_manifests`
says what they hold). This module talks to the API server: ``launch`` creates them, ``wait`` polls until
every pod is Running, ``replace`` deletes a lost pod (if it is still there) and creates one like it (same
spec and labels, name ``...-N-rK``), ``stop`` deletes what it created; :func:`cleanup`
(``textsql workers cleanup``) deletes them by label when the kernel that started them died. Deleting
what is already gone (404) is what was wanted, everywhere.

No cluster runs in this project's tests: they check the objects through the client's own (validating)
models, and run the backend against stand-ins with the client's ``CoreV1Api`` and ``NetworkingV1Api``
methods whose pods are local agent processes (tests/fakes/kubernetes_api.py), not a live cluster.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, Self

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from worker import constants as c
from worker.backends.base import Backend, Resources, WorkerHandle
from worker.backends.kubernetes_manifests import (
    APP_LABEL,
    RUN_LABEL,
    dns_name,
    pod_manifest,
    secret_manifest,
    secret_name,
)
from worker.backends.kubernetes_options import KubernetesOptions
from worker.backends.kubernetes_policy import Egress, network_policy_manifest, parse_egress, tracking_egress
from worker.errors import WorkerError
from worker.network import route_address
from worker.rendezvous.client import parse_endpoint
from worker.rendezvous.token import pod_key, read_token

logger = logging.getLogger(__name__)

_ENDED = {"Failed", "Succeeded"}
# The reason of a pod Kubernetes ended at its activeDeadlineSeconds (max_runtime_s).
DEADLINE_EXCEEDED = "DeadlineExceeded"


class KubernetesApis(NamedTuple):
    """The two APIs the backend calls, on one configured client."""

    core: Any  # kubernetes.client.CoreV1Api
    networking: Any  # kubernetes.client.NetworkingV1Api


def connect() -> KubernetesApis:
    """The APIs on in-cluster config inside a pod, else ~/.kube/config.

    :rtype: KubernetesApis
    """
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api_client = client.ApiClient()
    return KubernetesApis(client.CoreV1Api(api_client), client.NetworkingV1Api(api_client))


def _deleted(delete: Callable[..., Any], name: str, namespace: str, **options: Any) -> bool:
    """Delete one object; False when it was already gone (404: what deleting it wanted)."""
    try:
        delete(name, namespace, **options)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


class KubernetesBackend(Backend):
    """Worker pods in one namespace."""

    name = "kubernetes"
    # With project_claim the pods mount the run dir read-write (as the same user), the rest of the project read-only.
    shares_run_dir = True

    def __init__(self, options: KubernetesOptions, api: Any = None, networking_api: Any = None) -> None:
        """
        :param options: the pods, how often they are looked at and what they may reach.
        :param api: a ``CoreV1Api`` (default: in-cluster config, else ~/.kube/config).
        :param networking_api: a ``NetworkingV1Api`` for the run's NetworkPolicy (default: one on ``api``'s client).
        """
        self.options = options
        self._api = api
        self._networking = networking_api
        self._policy: str | None = None
        # Checked here, before any pod: a refused destination starts nothing.
        self.egress: list[Egress] = [parse_egress(entry) for entry in options.egress or ()]
        if options.egress_to_tracking:
            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:
                raise WorkerError("egress_to_tracking needs MLFLOW_TRACKING_URI set; set it, or leave the option out")
            self.egress += tracking_egress(uri)
        self.run_id = ""
        self._pods: list[str] = []
        # The Pod objects created, by name: a replacement is a copy of the lost one under a new name.
        self._bodies: dict[str, Any] = {}
        self._replaced = 0
        # The Secrets created, one per pod (its key), including those of replaced pods.
        self._secrets: list[str] = []

    @classmethod
    def from_options(cls, api: Any = None, networking_api: Any = None, **options: Any) -> Self:
        """The backend for notebook 02's ``backend_options``: :class:`KubernetesOptions` fields by name, and the
        APIs to call (by default the cluster's own, configured on first use).

        :rtype: KubernetesBackend
        """
        return cls(KubernetesOptions(**options), api, networking_api)

    @property
    def namespace(self) -> str:
        return self.options.namespace

    @property
    def api(self) -> Any:
        """The CoreV1Api, configured on first use.

        :rtype: kubernetes.client.CoreV1Api
        """
        if self._api is None:
            self._api, networking = connect()
            self._networking = self._networking or networking
        return self._api

    @property
    def networking(self) -> Any:
        """The NetworkingV1Api, on the same client as :attr:`api` unless given.

        :rtype: kubernetes.client.NetworkingV1Api
        """
        if self._networking is None:
            self._networking = client.NetworkingV1Api(self.api.api_client)
        return self._networking

    def advertised_address(self) -> str:
        return os.environ.get("POD_IP") or route_address(os.environ.get("KUBERNETES_SERVICE_HOST", "10.0.0.1"))

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(name) for name in self._pods]

    def pod_spec(self, index: int, resources: Resources, env: dict[str, str]) -> Any:
        """The Pod for worker ``index`` of this run (:func:`~worker.backends.kubernetes_manifests.pod_manifest`);
        its run directory is :attr:`workdir`'s parent, where ``start_workers`` put it.

        :rtype: kubernetes.client.V1Pod
        """
        run_dir = self.workdir.parent if self.workdir else None
        return pod_manifest(self.options, self.run_id, index, resources, env, run_dir)

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        run_name = self.workdir.parent.name if self.workdir else "run"
        self.run_id = self.run_id or f"{dns_name(run_name)}-{secrets.token_hex(3)}"
        if self.pod_key is None:  # called with the run's token rather than by start_workers
            self.pod_key = partial(pod_key, env.get(c.ENV_TOKEN) or read_token(Path(env[c.ENV_TOKEN_FILE])))
        start = len(self._pods)
        bodies = [self.pod_spec(index, resources, env) for index in range(start, start + count)]  # refusals first
        if self._policy is None and env.get(c.ENV_RENDEZVOUS):
            self._create_policy(env[c.ENV_RENDEZVOUS], int(env.get(c.ENV_SSH_PORT, c.DEFAULT_SSH_PORT)))
        for pod in bodies:
            self._create(pod)
            self._pods.append(pod.metadata.name)
        deadline = self.options.max_runtime_s
        logger.info(
            "created %d pods in namespace %s (run %s); %s",
            count,
            self.namespace,
            self.run_id,
            "no deadline" if deadline is None else f"Kubernetes ends them after {deadline / 3600:g} h (max_runtime_s)",
        )
        return self.pods[start:]

    def _create_policy(self, rendezvous: str, ssh_port: int) -> None:
        """The run's NetworkPolicy, before its first pod: no pod of the run ever runs unrestricted."""
        master, port = parse_endpoint(rendezvous)
        policy = network_policy_manifest(self.namespace, self.run_id, master, port, ssh_port, self.egress)
        self.networking.create_namespaced_network_policy(self.namespace, policy)
        self._policy = policy.metadata.name

    def _create(self, pod: Any) -> None:
        """Create ``pod``'s Secret (its own key), then the pod that mounts it."""
        name = pod.metadata.name
        assert self.pod_key is not None, "start_workers gives the backend its pod_key before any launch"
        self.api.create_namespaced_secret(self.namespace, secret_manifest(self.run_id, name, self.pod_key(name)))
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
            # The pod's own reason says why it ended (DeadlineExceeded, Evicted); its containers' why one waits.
            phases[pod.metadata.name] = (pod.status.phase or "Unknown", pod.status.reason or ", ".join(waiting))
        return phases

    def _ended(self, phase: str, reason: str) -> str:
        """Why a pod ended, with the fix where it is ours to name."""
        if reason == DEADLINE_EXCEEDED:
            return (
                f"ended with phase {phase}: {reason}, its max_runtime_s of {self.options.max_runtime_s} s passed; "
                "set a larger max_runtime_s in backend_options"
            )
        return f"ended with phase {phase}" + (f" ({reason})" if reason else "")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            phases = self._phases()
            ended = {name: self._ended(*state) for name, state in phases.items() if state[0] in _ENDED}
            if ended:
                described = "; ".join(f"{name} {why}" for name, why in sorted(ended.items()))
                raise WorkerError(f"pods ended before registering: {described}; see kubectl logs -n {self.namespace}")
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
            time.sleep(self.options.poll_s)

    def failures(self) -> dict[str, str]:
        return {name: self._ended(*state) for name, state in self._phases().items() if state[0] in _ENDED}

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
        self._delete("pod", self.api.delete_namespaced_pod, pod, grace_s=max(1.0, min(c.STOP_GRACE_S, timeout)))
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

    def _delete(self, kind: str, delete: Callable[..., Any], name: str, grace_s: float | None = None) -> None:
        """Delete one object of the run; any failure but "already gone" is logged, not raised."""
        options = {} if grace_s is None else {"grace_period_seconds": int(grace_s)}
        try:
            _deleted(delete, name, self.namespace, **options)
        except ApiException as error:
            logger.warning(
                "could not delete %s %s: %s; `textsql workers cleanup` deletes it by its labels",
                kind,
                name,
                error.reason,
            )

    def stop(self) -> None:
        for name in self._pods:
            self._delete("pod", self.api.delete_namespaced_pod, name, grace_s=c.STOP_GRACE_S)
        for name in self._secrets:
            self._delete("secret", self.api.delete_namespaced_secret, name)
        if self._policy:
            self._delete("network policy", self.networking.delete_namespaced_network_policy, self._policy)
        if self._pods:
            logger.info("deleted %d pods in namespace %s", len(self._pods), self.namespace)
        self._pods, self._bodies, self._secrets, self._policy = [], {}, [], None


@dataclass(frozen=True)
class Removed:
    """What :func:`cleanup` deleted, by kind (what was already gone is not counted)."""

    pods: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    network_policies: tuple[str, ...] = ()

    def __str__(self) -> str:
        """``2 pods, 2 secrets and 1 network policy``."""
        counts = [(len(self.pods), "pod", "pods"), (len(self.secrets), "secret", "secrets")]
        counts.append((len(self.network_policies), "network policy", "network policies"))
        parts = [f"{count} {one if count == 1 else many}" for count, one, many in counts]
        return f"{', '.join(parts[:-1])} and {parts[-1]}"


def cleanup(apis: KubernetesApis, namespace: str, run_id: str | None = None) -> Removed:
    """Delete the worker Pods, key Secrets and NetworkPolicy of one run (or of every run) by their labels.

    For runs whose kernel died before ``stop``: the labels are all that is left to find them by. An object
    gone between listing and deleting it (a pod that finished terminating, a second cleanup) is skipped.

    :param apis: the APIs (:func:`connect`).
    :param namespace: the namespace the workers ran in.
    :param run_id: the run's id (the ``textsql/run`` label; None: every textsql run in the namespace).
    :rtype: Removed
    :raises WorkerError: naming what could not be deleted and why, after deleting everything else.
    """
    selector = APP_LABEL + (f",{RUN_LABEL}={run_id}" if run_id else "")
    kinds = {
        "pod": (
            apis.core.list_namespaced_pod,
            partial(apis.core.delete_namespaced_pod, grace_period_seconds=int(c.STOP_GRACE_S)),
        ),
        "secret": (apis.core.list_namespaced_secret, apis.core.delete_namespaced_secret),
        "network policy": (
            apis.networking.list_namespaced_network_policy,
            apis.networking.delete_namespaced_network_policy,
        ),
    }
    removed: dict[str, list[str]] = {kind: [] for kind in kinds}
    failed = []
    for kind, (list_objects, delete) in kinds.items():
        for item in list_objects(namespace, label_selector=selector).items:
            try:
                if _deleted(delete, item.metadata.name, namespace):
                    removed[kind].append(item.metadata.name)
            except ApiException as error:
                failed.append(f"{kind} {item.metadata.name} ({error.status} {error.reason})")
    result = Removed(tuple(removed["pod"]), tuple(removed["secret"]), tuple(removed["network policy"]))
    logger.info("deleted %s labelled %s in namespace %s", result, selector, namespace)
    if failed:
        raise WorkerError(
            f"deleted {result} in namespace {namespace} but not {', '.join(failed)}; "
            f"check that you may delete them (kubectl auth can-i delete pods,secrets,networkpolicies -n {namespace})"
        )
    return result
