"""Every backend option is on the site with its default (docs/hooks/backend_options.py generates the tables from
the code), and the kubernetes backend's pod deadline is said up front: long enough for a long run, logged at the
launch, and named when it ends a pod."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import logging
import re

import pytest
from fakes.kubernetes_api import RecordingCoreV1, RecordingNetworkingV1
from kubernetes import client

from textsql.constants import PROJECT_DIR
from worker import constants as c
from worker.backends import Resources
from worker.backends.cml import CMLBackend
from worker.backends.kubernetes import KubernetesBackend
from worker.backends.kubernetes_options import KubernetesOptions
from worker.backends.slurm_options import SlurmOptions
from worker.backends.static import StaticBackend
from worker.errors import WorkerError
from worker.rendezvous.token import new_token

HOOK = PROJECT_DIR / "docs" / "hooks" / "backend_options.py"
PAGES = {
    "kubernetes": PROJECT_DIR / "docs" / "platforms" / "kubernetes-operator.md",
    "static": PROJECT_DIR / "docs" / "platforms" / "ssh-hosts.md",
    "cml": PROJECT_DIR / "docs" / "platforms" / "cml.md",
    "slurm": PROJECT_DIR / "docs" / "platforms" / "slurm.md",
}


def hook():
    spec = importlib.util.spec_from_file_location("backend_options_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def options(backend: str) -> dict[str, object]:
    """What ``backend_options`` takes, read here from the code by another route than the hook's: name -> default."""
    if backend in ("kubernetes", "slurm"):
        return {
            field.name: field.default if field.default is not dataclasses.MISSING else None
            for field in dataclasses.fields({"kubernetes": KubernetesOptions, "slurm": SlurmOptions}[backend])
        }
    cls = {"static": StaticBackend, "cml": CMLBackend}[backend]
    parameters = inspect.signature(cls).parameters.values()
    return {p.name: None if p.default is p.empty else p.default for p in parameters if p.name != "api"}


@pytest.mark.parametrize("backend", sorted(PAGES))
def test_every_option_of_the_backend_is_on_its_page_with_its_default(backend):
    page = hook().on_page_markdown(PAGES[backend].read_text(), None, None, None)
    wanted = options(backend)
    assert wanted
    for name, default in wanted.items():
        shown = "required" if default is None and name in ("image", "hosts") else f"`{default!r}`"
        assert f"| `{name}` | {shown} |" in page, f"{PAGES[backend].name} lacks {name} = {default!r}"
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(wanted), rows  # no option the backend does not take


def test_the_slurm_page_lists_every_sbatch_flag_the_backend_allows():
    from worker.backends.slurm_options import ALLOWED_SBATCH_FLAGS

    page = PAGES["slurm"].read_text()
    listed = page.split("`sbatch_flags` takes these", 1)[1].split("Other flags are refused", 1)[0]
    assert set(re.findall(r"`(--[a-z-]+)`", listed)) == ALLOWED_SBATCH_FLAGS


def test_an_option_without_a_description_stops_the_build(monkeypatch):
    from mkdocs.exceptions import PluginError

    generated = hook()
    monkeypatch.setattr(generated, "parameter_docs", lambda docstring: {})
    with pytest.raises(PluginError, match="the 'static' backend's option 'hosts' has no description"):
        generated.options_table("static")


@pytest.mark.parametrize("backend", sorted(PAGES))
def test_a_generated_table_shows_values_never_the_codes_internal_names(backend):
    from worker.backends import BACKENDS

    table = hook().options_table(backend)
    modules = [BACKENDS[backend], hook().OPTIONS_CLASSES.get(backend, BACKENDS[backend])]
    internal = {name for module in modules for name in vars(importlib.import_module(module.split(":")[0]))}
    shown = set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", table))  # ALLOWED_SBATCH_FLAGS and the like
    assert not shown & internal, f"the {backend} table shows the code's names {sorted(shown & internal)}"
    assert ":data:" not in table


def test_the_slurm_options_table_lists_the_allowed_sbatch_flags_themselves():
    from worker.backends.slurm_options import ALLOWED_SBATCH_FLAGS

    (row,) = [line for line in hook().options_table("slurm").splitlines() if line.startswith("| `sbatch_flags` |")]
    assert set(re.findall(r"`(--[a-z-]+)`", row)) == ALLOWED_SBATCH_FLAGS


def test_a_data_role_naming_no_constant_stops_the_build():
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="names :data:`NOT_THERE`, which its module lacks"):
        hook().constants_shown("the flags of :data:`NOT_THERE`", {})


def test_the_slurm_page_names_the_workers_timeout_with_the_default_the_code_has():
    from worker.cluster import start_workers

    default = inspect.signature(start_workers).parameters["timeout"].default
    assert f"`start_workers`' `timeout`, **{default:.0f} s** by default" in PAGES["slurm"].read_text()
    # The page's way to change it: notebook 02 hands its backend_options to start_workers as keywords, so a
    # "timeout" key there is start_workers' own timeout, not a backend option.
    cells = json.loads((PROJECT_DIR / "notebooks" / "02_train_distributed.ipynb").read_text())["cells"]
    code = "\n".join("".join(cell["source"]) for cell in cells)
    assert re.search(
        r"with start_workers\((?:(?!\) as cluster).)*\*\*backend_options,\s*\) as cluster", code, re.DOTALL
    )
    assert "timeout" not in options("slurm")
    backend_options = {"partition": "gpu", "timeout": 3600}  # the page's example
    bound = inspect.signature(start_workers).bind("slurm", 2, "runs/r1", **backend_options)
    assert bound.arguments["timeout"] == 3600 and bound.arguments["backend_options"] == {"partition": "gpu"}


def test_the_pod_deadline_is_a_week_logged_at_the_launch_and_none_means_none(tmp_path, caplog):
    token_file = tmp_path / "token"
    new_token(token_file)
    env = {c.ENV_TOKEN_FILE: str(token_file), c.ENV_RENDEZVOUS: "10.0.0.4:29400"}
    for deadline, said in ((None, "no deadline"), (7 * 24 * 3600, "Kubernetes ends them after 168 h (max_runtime_s)")):
        api = RecordingCoreV1()
        options = {} if deadline else {"max_runtime_s": None}
        backend = KubernetesBackend(
            KubernetesOptions(image="img", **options), api=api, networking_api=RecordingNetworkingV1()
        )
        with caplog.at_level(logging.INFO, logger="worker.backends.kubernetes"):
            backend.launch(1, Resources(), env)
        assert said in caplog.text
        assert [pod.spec.active_deadline_seconds for pod in api.pods.values()] == [deadline]


class DeadlinePassed(RecordingCoreV1):
    """Pods that Kubernetes ended at their activeDeadlineSeconds, as the API server reports them."""

    def list_namespaced_pod(self, namespace, label_selector=None):
        listed = super().list_namespaced_pod(namespace, label_selector=label_selector)
        for pod in listed.items:
            pod.status = client.V1PodStatus(phase="Failed", reason="DeadlineExceeded")
        return listed


def test_a_pod_ended_by_the_deadline_is_named_with_the_option_that_raises_it(tmp_path):
    token_file = tmp_path / "token"
    new_token(token_file)
    backend = KubernetesBackend(
        KubernetesOptions(image="img", max_runtime_s=3600, poll_s=0.01),
        api=DeadlinePassed(),
        networking_api=RecordingNetworkingV1(),
    )
    (handle,) = backend.launch(1, Resources(), {c.ENV_TOKEN_FILE: str(token_file)})
    why = "ended with phase Failed: DeadlineExceeded, its max_runtime_s of 3600 s passed; set a larger max_runtime_s"
    assert backend.failures() == {handle.pod: f"{why} in backend_options"}
    with pytest.raises(WorkerError, match=f"pods ended before registering: {handle.pod} {why}"):
        backend.wait(timeout=1)
