"""A package that installs: every runtime import declared in pyproject.toml and pinned in requirements.txt, and a
wheel that, installed into a fresh venv beside only what it declares, runs the CLI and the notebooks' imports."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from zipfile import ZipFile

import pytest
from helpers.paths import PROJECT_DIR
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PACKAGES = ("textsql", "worker")
EXTRAS = ("notebooks", "kubernetes", "tracking")
# Extras the runtime (requirements.txt: the AMP, the image) leaves out, pinned in requirements-dev.txt for the
# tests: MLflow, which CML's runtimes bring themselves (CML Experiments) and a pinned copy would overwrite.
DEV_PINNED_EXTRAS = ("tracking",)
PYPROJECT = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]
NOTEBOOKS = sorted((PROJECT_DIR / "notebooks").glob("*.ipynb"))


def declared(extras: tuple[str, ...] = EXTRAS) -> dict[str, Requirement]:
    """The project's requirements with these extras, by canonical name."""
    lines = [
        *PYPROJECT["dependencies"],
        *(line for extra in extras for line in PYPROJECT.get("optional-dependencies", {}).get(extra, [])),
    ]
    return {canonicalize_name(requirement.name): requirement for requirement in map(Requirement, lines)}


def imported_distributions() -> dict[str, set[str]]:
    """The installed distributions the package's modules import at run time, each with the modules importing it
    (imports under ``if TYPE_CHECKING:`` excluded: they never run)."""
    owners = importlib.metadata.packages_distributions()
    wanted = declared()
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (PROJECT_DIR / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            checking = {
                id(node)
                for block in ast.walk(tree)
                if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                for node in ast.walk(block)
            }
            for node in ast.walk(tree):
                if id(node) in checking:
                    continue
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in PACKAGES:
                        continue
                    # A module several distributions install (mlflow's: mlflow, mlflow-skinny, mlflow-tracing)
                    # is declared through any one of them.
                    owning = owners.get(top, [f"<not installed: {top}>"])
                    for distribution in [name for name in owning if canonicalize_name(name) in wanted] or owning:
                        found.setdefault(canonicalize_name(distribution), set()).add(str(path.relative_to(PROJECT_DIR)))
    return found


def pinned(file: str = "requirements.txt") -> dict[str, str]:
    """A requirements file's ``name==version`` pins by canonical name."""
    pins = {}
    for line in (PROJECT_DIR / file).read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_every_runtime_import_is_declared_and_pinned():
    imports, requirements, pins = imported_distributions(), declared(), pinned()
    assert not {name: sorted(modules) for name, modules in imports.items() if name not in requirements}, (
        "imported but not in pyproject's dependencies or extras"
    )
    runtime = declared(tuple(extra for extra in EXTRAS if extra not in DEV_PINNED_EXTRAS))
    assert sorted(set(runtime) - set(pins)) == [], "declared but not pinned in requirements.txt"
    assert sorted(set(requirements) - set(runtime) - set(pinned("requirements-dev.txt"))) == [], (
        f"extras {DEV_PINNED_EXTRAS} declared but not pinned in requirements-dev.txt"
    )
    # The venv's builds may carry a local label (torch's +cpu): the pin names the public version.
    installed = {name: Version(importlib.metadata.version(name)).public for name in pins}
    assert {name: (version, installed[name]) for name, version in pins.items() if installed[name] != version} == {}


def dependency_closure(
    requirements: list[Requirement], extras: tuple[str, ...] = ()
) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that these requirements need, transitively, each checked against its specifier."""
    environment = default_environment()
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [(requirement, extra) for requirement in requirements for extra in ("", *extras)]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({**environment, "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        distribution = importlib.metadata.distribution(name)
        assert requirement.specifier.contains(distribution.version, prereleases=True), (
            f"{requirement} is required but {distribution.version} is installed"
        )
        if name in found:
            continue
        found[name] = distribution
        pending += [
            (Requirement(line), wanted) for line in distribution.requires or [] for wanted in ("", *requirement.extras)
        ]
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built offline from a copy of the sources (the checkout gets no build/ directory)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in (*PACKAGES, "pyproject.toml", "README.md"):
        if (PROJECT_DIR / name).is_dir():
            shutil.copytree(PROJECT_DIR / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(PROJECT_DIR / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(source), "-w", str(dist)],
        check=True,
        timeout=300,
    )
    return next(dist.glob("textsql-*.whl"))


@pytest.mark.slow
def test_the_wheel_holds_every_subpackage_and_the_assets(wheel):
    names = set(ZipFile(wheel).namelist())
    for package in PACKAGES:
        for init in (PROJECT_DIR / package).rglob("__init__.py"):
            assert str(init.relative_to(PROJECT_DIR)) in names
    assets = PROJECT_DIR / "textsql" / "assets"
    assert {str(path.relative_to(PROJECT_DIR)) for path in assets.rglob("*") if path.is_file()} <= names
    # dsconfig/ reaches the wheel through the textsql/assets/dsconfig link: every profile and overlay.
    profiles = PROJECT_DIR / "dsconfig"
    assert {f"textsql/assets/dsconfig/{path.relative_to(profiles)}" for path in profiles.rglob("*.json")} <= names


def notebook_modules() -> list[str]:
    """Every module the notebooks' code cells import."""
    modules = set()
    for notebook in NOTEBOOKS:
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "\n".join(line for line in "".join(cell["source"]).splitlines() if not line.startswith(("%", "!")))
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Import):
                    modules |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module:
                    modules.add(node.module)
    return sorted(modules)


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A plain venv (no system or shared site-packages) with the wheel installed by pip, no -e, and beside it
    only the distributions the wheel declares with its extras, transitively: each linked from this venv's
    site-packages (installing torch and DeepSpeed again would take long and need the network). An import
    the package does not declare finds nothing there."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    # Without PYTHONPATH: pip in the fresh venv must not see the checkout (nor anything installed from it).
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    extras = ",".join(EXTRAS)
    subprocess.run(
        [*pip, "install", "-q", "--no-deps", "--no-index", f"{wheel}[{extras}]"], check=True, env=env, timeout=300
    )
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    ours = importlib.metadata.Distribution.at(next(site.glob("textsql-*.dist-info")))
    closure = dependency_closure([Requirement(line) for line in ours.requires or []], EXTRAS)
    for distribution in closure.values():
        root = Path(distribution.locate_file(""))
        for top in {Path(file).parts[0] for file in distribution.files or []} - {".."}:
            if not (site / top).exists():
                (site / top).symlink_to(root / top)
    checked = subprocess.run([*pip, "check"], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return venv


def run_fresh(venv: Path, *command: str) -> subprocess.CompletedProcess:
    """A command of the fresh venv, run outside the checkout with no PYTHONPATH (nothing of the sources in reach)."""
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [str(venv / "bin" / command[0]), *command[1:]],
        check=False,
        cwd=venv,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
# The sum of its bounds: the wheel (300 s), the venv (120 + 300 + 300 s) and three commands in it (300 s each).
@pytest.mark.timeout(300 + 120 + 300 + 300 + 3 * 300 + 60)
def test_a_fresh_venv_runs_the_cli_and_every_notebook_import(fresh_venv):
    helped = run_fresh(fresh_venv, "textsql", "--help")
    assert helped.returncode == 0 and "estimate" in helped.stdout, helped.stderr
    estimated = run_fresh(fresh_venv, "textsql", "estimate", "--gpu-memory-gb", "24", "--json")
    assert estimated.returncode == 0, estimated.stderr[-3000:]
    assert json.loads(estimated.stdout)["profiles"], estimated.stdout
    modules = notebook_modules()
    assert "textsql.inference.predict" in modules and "worker.cluster" in modules
    imported = run_fresh(fresh_venv, "python", "-c", f"import {', '.join(modules)}, textsql; print(textsql.__file__)")
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.strip().startswith(str(fresh_venv)), imported.stdout
