"""The architecture kept by tools: import contracts (pyproject.toml's [tool.importlinter])."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import PROJECT_DIR

PACKAGES = ("textsql", "worker")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    executable = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    return subprocess.run(
        [executable, "--no-cache"],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
    )


def test_import_contracts_hold():
    result = lint_imports(PROJECT_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, wrong_import, broken",
    [
        ("worker/hostfile.py", "from textsql.errors import DataError", "worker.hostfile -> textsql.errors"),
        (
            "textsql/data/sql.py",
            "from textsql.inference.predict import Predictor",
            "textsql.data.sql -> textsql.inference.predict",
        ),
        # Type-checking imports count: the cycle LaunchArguments once hid this way breaks the contract.
        (
            "textsql/launching/command.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from textsql.launching.launch import launch",
            "- .command -> .launch",
        ),
        # worker/'s own layers: a backend never imports the pod's entry program, nor a format a helper.
        (
            "worker/backends/kubernetes.py",
            "from worker.agent import AgentConfig",
            "worker.backends.kubernetes -> worker.agent",
        ),
        # The kubernetes backend's manifests are built without its API calls.
        (
            "worker/backends/kubernetes_manifests.py",
            "from worker.backends.kubernetes import connect",
            "worker.backends.kubernetes_manifests -> worker.backends.kubernetes",
        ),
        ("worker/network.py", "from worker.registration import Registration", "worker.network -> worker.registration"),
        ("worker/hostfile.py", "from worker.runfiles import RunFiles", "worker.hostfile -> worker.runfiles"),
        # and every module of worker/ has a layer: a new one that has none breaks the contract.
        ("worker/newcomer.py", "import worker.errors", "- worker.newcomer"),
    ],
)
def test_an_import_going_the_wrong_way_breaks_a_contract(tmp_path, module, wrong_import, broken):
    """The contracts are not vacuous: a copy of the tree with one import the wrong way fails them."""
    for name in (*PACKAGES, "pyproject.toml"):
        source = PROJECT_DIR / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("assets", "__pycache__"))
        else:
            shutil.copy(source, tmp_path / name)
    path = tmp_path / module
    path.write_text((path.read_text() if path.exists() else "") + f"\n{wrong_import}  # the wrong way\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert broken in result.stdout and " broken" in result.stdout


def test_no_module_imports_a_private_name_of_another():
    offenders = []
    for package in PACKAGES:
        for path in sorted((PROJECT_DIR / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    offenders += [
                        f"{path.relative_to(PROJECT_DIR)}: {node.module}.{alias.name}"
                        for alias in node.names
                        if alias.name.startswith("_")
                    ]
    assert offenders == []


# What runs on the launching machine before the ranks start: none of it may import the training stack,
# whose import (2-5 s each) lies on the way to the first training step.
MASTER_MODULES = (
    "textsql.cli",
    "textsql.launching.launch",
    "textsql.launching.supervisor",
    "textsql.launching.cluster_check",
    "worker.cluster",
    "worker.rendezvous.server",
    "worker.agent",
)
TRAINING_STACK = ("torch", "transformers", "datasets", "deepspeed", "accelerate")


@pytest.mark.parametrize("module", MASTER_MODULES)
def test_the_launching_path_imports_no_training_stack(module):
    script = f"import sys, {module}\nprint(' '.join(name for name in {TRAINING_STACK!r} if name in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=PROJECT_DIR)
    assert done.stdout.split() == [], f"importing {module} imports {done.stdout.strip()}"
