"""`textsql workers cleanup`: a dead Kubernetes run's pods, Secrets and NetworkPolicy deleted by label, what was
already gone not counted, what could not be deleted named after the rest is deleted."""

from __future__ import annotations

import pytest
from fakes.kubernetes_api import RecordingCoreV1, RecordingNetworkingV1
from kubernetes.client.exceptions import ApiException

from worker import constants as c
from worker.backends import Resources
from worker.backends.kubernetes import KubernetesApis, KubernetesBackend, cleanup
from worker.backends.kubernetes_options import KubernetesOptions
from worker.errors import WorkerError
from worker.rendezvous.token import new_token


def launched_runs(tmp_path, count: int, api=None) -> tuple[KubernetesApis, list[KubernetesBackend]]:
    """``count`` runs of two pods each, launched on stand-ins for the API server."""
    token_file = tmp_path / "token"
    new_token(token_file)
    apis = KubernetesApis(api or RecordingCoreV1(), RecordingNetworkingV1())
    runs = [
        KubernetesBackend(KubernetesOptions(image="img"), api=apis.core, networking_api=apis.networking)
        for _ in range(count)
    ]
    for backend in runs:
        backend.launch(2, Resources(), {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:1"})
    return apis, runs


def test_workers_cleanup_deletes_a_dead_runs_pods_secrets_and_policy_by_label(tmp_path, monkeypatch):
    """The kernel died without stop(): `textsql workers cleanup --run` finds its objects by label."""
    from click.testing import CliRunner

    from textsql.cli import cli
    from worker.backends import kubernetes

    apis, (dead, alive) = launched_runs(tmp_path, 2)
    monkeypatch.setattr(kubernetes, "connect", lambda: apis)
    result = CliRunner().invoke(cli, ["workers", "cleanup", "--namespace", "default", "--run", dead.run_id])
    assert result.exit_code == 0, result.output
    assert result.output == "deleted 2 pods, 2 secrets and 1 network policy in namespace default\n"
    assert sorted(apis.core.pods) == [p.pod for p in alive.pods] and len(apis.core.secrets) == 2
    assert list(apis.networking.policies) == [f"textsql-{alive.run_id}-workers"]
    result = CliRunner().invoke(cli, ["workers", "cleanup"])
    assert result.exit_code == 0 and apis.core.pods == {} and apis.core.secrets == {}, result.output
    assert apis.networking.policies == {}
    result = CliRunner().invoke(cli, ["workers", "cleanup"])
    assert result.output == "deleted 0 pods, 0 secrets and 0 network policies in namespace default\n"


class PodsGoingAway(RecordingCoreV1):
    """Pods that finish terminating (stop() of a kernel still dying) while cleanup runs: listed, then gone."""

    def list_namespaced_pod(self, namespace, label_selector=None):
        listed = super().list_namespaced_pod(namespace, label_selector=label_selector)
        self.pods.pop(listed.items[0].metadata.name)
        return listed


def test_cleanup_counts_only_what_it_deleted_and_goes_on_past_what_is_already_gone(tmp_path):
    apis, (run,) = launched_runs(tmp_path, 1, api=PodsGoingAway())
    gone, left = (pod.pod for pod in run.pods)
    removed = cleanup(apis, "default", run.run_id)
    assert removed.pods == (left,) and removed.secrets == (f"{gone}-key", f"{left}-key")
    assert removed.network_policies == (f"textsql-{run.run_id}-workers",)
    assert str(removed) == "1 pod, 2 secrets and 1 network policy"
    assert apis.core.pods == {} and apis.core.secrets == {} and apis.networking.policies == {}


class ForbiddenSecrets(RecordingCoreV1):
    def delete_namespaced_secret(self, name, namespace):
        raise ApiException(status=403, reason="Forbidden")


def test_cleanup_names_what_it_could_not_delete_after_deleting_the_rest(tmp_path):
    apis, (run,) = launched_runs(tmp_path, 1, api=ForbiddenSecrets())
    first, second = (f"{pod.pod}-key" for pod in run.pods)
    with pytest.raises(
        WorkerError,
        match=rf"deleted 2 pods, 0 secrets and 1 network policy in namespace default but not secret {first} "
        rf"\(403 Forbidden\), secret {second} \(403 Forbidden\); check that you may delete them \(kubectl auth can-i",
    ):
        cleanup(apis, "default", run.run_id)
    assert apis.core.pods == {} and apis.networking.policies == {} and len(apis.core.secrets) == 2
