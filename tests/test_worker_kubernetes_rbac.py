"""The Role of docs/platforms/kubernetes-rbac.yaml (the operator's page includes the file) grants the notebook's
service account exactly the requests the kubernetes backend and `textsql workers cleanup` make: every request
their code can make is granted, nothing else is, and their whole lifecycle runs on a stand-in API server that
refuses what the Role does not grant with a 403."""

from __future__ import annotations

import ast
import re

import pytest
from fakes.kubernetes_api import RecordingCoreV1, RecordingNetworkingV1, RoleBound, authorization, granted, role_rules
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from textsql.constants import PROJECT_DIR
from worker import constants as c
from worker.backends import Resources
from worker.backends.kubernetes import KubernetesApis, KubernetesBackend, cleanup
from worker.backends.kubernetes_options import KubernetesOptions
from worker.errors import WorkerError
from worker.rendezvous.token import new_token

MANIFESTS = PROJECT_DIR / "docs" / "platforms" / "kubernetes-rbac.yaml"
PAGE = PROJECT_DIR / "docs" / "platforms" / "kubernetes-operator.md"
APIS = (client.CoreV1Api, client.NetworkingV1Api, client.RbacAuthorizationV1Api, client.AppsV1Api)


def requests_in_code() -> dict[tuple[str, str, str], list[str]]:
    """Every request to the API server that the code which imports ``kubernetes`` names, by what authorizes it:
    each attribute spelled like a client method (``create_namespaced_pod``), with where it is named."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for path in sorted([*(PROJECT_DIR / "worker").rglob("*.py"), *(PROJECT_DIR / "textsql").rglob("*.py")]):
        source = path.read_text()
        if not re.search(r"^\s*(from|import) kubernetes\b", source, re.MULTILINE):
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Attribute):
                continue
            owners = [api for api in APIS if hasattr(api, f"_{node.attr}_serialize")]
            if owners:
                where = f"{path.relative_to(PROJECT_DIR)}:{node.lineno} {node.attr}"
                found.setdefault(authorization(owners[0], node.attr), []).append(where)
    return found


def test_the_role_grants_exactly_the_requests_the_code_makes():
    _, rules = role_rules(MANIFESTS)
    needed = requests_in_code()
    assert needed, "no request to the API server found in the code: the scan is broken"
    missing = {request: where for request, where in needed.items() if request not in granted(rules)}
    assert not missing, f"the code makes requests the Role does not grant (add them to {MANIFESTS.name}): {missing}"
    unused = granted(rules) - needed.keys()
    assert not unused, f"the Role grants what no code requests (remove it): {unused}"


def test_the_manifests_bind_the_role_to_the_notebooks_service_account_in_its_namespace():
    import yaml

    documents = {document["kind"]: document for document in yaml.safe_load_all(MANIFESTS.read_text())}
    assert set(documents) == {"ServiceAccount", "Role", "RoleBinding"}
    account, role, binding = documents["ServiceAccount"], documents["Role"], documents["RoleBinding"]
    namespace = role["metadata"]["namespace"]
    assert account["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": namespace}
    ]
    # The client's own models accept each (a misspelt field would be refused by the API server).
    for kind, model in (("Role", client.V1Role), ("RoleBinding", client.V1RoleBinding)):
        assert client.ApiClient()._ApiClient__deserialize(documents[kind], model).metadata.namespace == namespace


def test_the_operators_page_includes_the_committed_manifests():
    page = PAGE.read_text()
    assert re.search(r'```yaml\n--8<-- "docs/platforms/kubernetes-rbac.yaml"\n```', page), "include the file"
    assert "kubernetes-operator.md" in (PAGE.parent / "kubernetes.md").read_text()  # the user's page links to it


def role_bound(rules: list[dict] | None = None, namespace: str | None = None):
    """The two stand-in APIs behind the Role's authorizer (its own rules and namespace unless given)."""
    own_namespace, own_rules = role_rules(MANIFESTS)
    namespace, rules = namespace or own_namespace, own_rules if rules is None else rules
    return KubernetesApis(
        RoleBound(RecordingCoreV1(), client.CoreV1Api, namespace, rules),
        RoleBound(RecordingNetworkingV1(), client.NetworkingV1Api, namespace, rules),
    )


def launched(apis: KubernetesApis, tmp_path, namespace: str = "ml") -> KubernetesBackend:
    token_file = tmp_path / "token"
    new_token(token_file)
    backend = KubernetesBackend(
        KubernetesOptions(image="img", namespace=namespace, poll_s=0.01), api=apis.core, networking_api=apis.networking
    )
    backend.launch(2, Resources(), {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:29400"})
    return backend


def test_the_backends_whole_lifecycle_runs_under_exactly_that_role(tmp_path, caplog):
    apis = role_bound()
    backend = launched(apis, tmp_path)
    backend.wait(timeout=5)
    assert backend.failures() == {}
    replaced = backend.replace(backend.pods[1].pod, timeout=1)
    backend.stop()
    assert "could not delete" not in caplog.text
    assert apis.core.api.pods == {} and apis.core.api.secrets == {} and apis.networking.api.policies == {}
    dead = launched(apis, tmp_path)  # a kernel that died: `textsql workers cleanup` finds the rest by label
    assert str(cleanup(apis, "ml", dead.run_id)) == "2 pods, 2 secrets and 1 network policy"
    _, rules = role_rules(MANIFESTS)
    assert apis.core.requests | apis.networking.requests == granted(rules)  # every grant was needed
    assert replaced.pod.endswith("-r1")


def test_a_request_the_role_does_not_grant_is_refused_with_403(tmp_path):
    _, rules = role_rules(MANIFESTS)
    without_secret_deletes = [
        {**rule, "verbs": [v for v in rule["verbs"] if v != "delete"]} if rule["resources"] == ["secrets"] else rule
        for rule in rules
    ]
    apis = role_bound(without_secret_deletes)
    dead = launched(apis, tmp_path)
    with pytest.raises(WorkerError, match=r"but not secret \S+ \(403 secrets is forbidden: .* cannot delete"):
        cleanup(apis, "ml", dead.run_id)
    with pytest.raises(ApiException) as refused:  # the Role is the namespace's: another namespace gets nothing
        launched(role_bound(), tmp_path, namespace="default")
    assert refused.value.status == 403 and 'cannot create resource "networkpolicies"' in refused.value.reason
