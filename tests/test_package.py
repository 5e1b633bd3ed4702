"""A package that installs: every runtime import declared in pyproject.toml and pinned in requirements.txt, a
wheel that, installed into a fresh venv beside only what it declares, runs the CLI and the notebooks' imports, and
every declared extra resolved together by plain pip, installed and running ``textsql prepare``."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path
from zipfile import ZipFile

import pytest
from helpers.paths import PROJECT_DIR
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PACKAGES = ("textsql", "worker")
PYPROJECT = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]
# Every declared extra.
EXTRAS = tuple(PYPROJECT["optional-dependencies"])
# Extras the runtime (requirements.txt: the AMP, the image) leaves out, each pinned in its own file: MLflow, which
# CML's runtimes bring themselves (CML Experiments) and a pinned copy would overwrite; s3fs, which only a checkpoint
# store in S3 needs.
PINNED_ELSEWHERE = {"tracking": "requirements-dev.txt", "store": "requirements-store.txt"}
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
    runtime = declared(tuple(extra for extra in EXTRAS if extra not in PINNED_ELSEWHERE))
    assert sorted(set(runtime) - set(pins)) == [], "declared but not pinned in requirements.txt"
    for extra, file in PINNED_ELSEWHERE.items():
        assert sorted(set(declared((extra,))) - set(runtime) - set(pins) - set(pinned(file))) == [], (
            f"the {extra} extra declared but not pinned in {file}"
        )
    # The venv's builds may carry a local label (torch's +cpu): the pin names the public version.
    installed = {name: Version(importlib.metadata.version(name)).public for name in pins}
    assert {name: (version, installed[name]) for name, version in pins.items() if installed[name] != version} == {}


def dependency_closure(
    requirements: list[Requirement], extras: tuple[str, ...] = (), checked: bool = True
) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that these requirements need, transitively, each checked against its specifier
    (unless not ``checked``: then what is not installed is left out, with what only it needs). A distribution
    required with extras (``jsonschema[format-nongpl]``) brings what those extras need, wherever it was met first."""
    environment = default_environment()
    found: dict[str, importlib.metadata.Distribution] = {}
    walked: set[tuple[str, str]] = set()
    pending = [(requirement, extra) for requirement in requirements for extra in ("", *extras)]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({**environment, "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            if checked:
                raise
            continue
        assert not checked or requirement.specifier.contains(distribution.version, prereleases=True), (
            f"{requirement} is required but {distribution.version} is installed"
        )
        new = [wanted for wanted in ("", *requirement.extras) if (name, wanted) not in walked]
        walked |= {(name, wanted) for wanted in new}
        found[name] = distribution
        pending += [(Requirement(line), wanted) for line in distribution.requires or [] for wanted in new]
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


def site_packages(venv: Path) -> Path:
    """A venv's site-packages."""
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def link(distributions: Iterable[importlib.metadata.Distribution], directory: Path) -> None:
    """Link these installed distributions' top-level files and directories (their metadata included) from
    ``directory``, where a name is not there yet."""
    for distribution in distributions:
        root = Path(distribution.locate_file(""))
        for top in {Path(file).parts[0] for file in distribution.files or []} - {".."}:
            if not (directory / top).exists():
                (directory / top).symlink_to(root / top)


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
    site = site_packages(venv)
    ours = importlib.metadata.Distribution.at(next(site.glob("textsql-*.dist-info")))
    link(dependency_closure([Requirement(line) for line in ours.requires or []], EXTRAS).values(), site)
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


# Seconds allowed to pip's resolve of every extra from the index: a couple of minutes where it finds a set (under one
# here with requirements-dev.txt's pip, which reads the index's metadata files; two with Python 3.11's pip 23, which
# downloads each candidate wheel); botocore's python-dateutil<3 against the kubernetes client's >=3 had it backtrack
# through every aiobotocore and botocore release for over 11 minutes.
RESOLVE_S = 300


@pytest.mark.slow
# The sum of its bounds: the wheel (300 s), the venv (120 s), the resolve, the install (300 s), pip check (120 s) and
# two commands in the venv (300 s each).
@pytest.mark.timeout(300 + 120 + RESOLVE_S + 300 + 120 + 2 * 300 + 60)
def test_every_extra_resolves_and_installs_with_plain_pip_then_prepares(wheel, tmp_path: Path) -> None:
    """``pip install 'textsql[every extra]'`` as a user runs it: first resolved from the index in a fresh venv with
    nothing installed counted (``--ignore-installed``: the set pip would choose there, found within RESOLVE_S).
    Then installed with dependency resolution under the project's pins, where the distributions this venv has at
    those versions are reused from a directory of links outside the new venv (pip never removes what lies outside
    its environment): pip installs the rest itself. Then ``pip check`` and ``textsql prepare`` from the new venv."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(venv / "bin" / "python")]
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    target = f"textsql[{','.join(EXTRAS)}] @ {wheel.as_uri()}"
    report = tmp_path / "report.json"
    try:
        resolved = subprocess.run(
            [*pip, "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report), target],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=RESOLVE_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip found no set of every extra ({', '.join(EXTRAS)}) within {RESOLVE_S} s: it backtracks")
    assert resolved.returncode == 0, resolved.stderr[-5000:]
    chosen = {canonicalize_name(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}
    assert sorted(set(declared()) - chosen) == [], "declared but left out of the resolve"

    pins = pinned() | pinned("requirements-store.txt") | pinned("requirements-dev.txt")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    installed = dependency_closure(list(declared().values()), checked=False)
    # Named site-packages as where pip puts them: dill (datasets' fingerprints) pickles a module from any other
    # directory by value, and pyarrow's cannot be.
    layer = tmp_path / "installed" / "site-packages"
    layer.mkdir(parents=True)
    link(
        (
            distribution
            for name, distribution in installed.items()
            if name not in pins or Version(Version(distribution.version).public) == Version(pins[name])
        ),
        layer,
    )
    (site_packages(venv) / "installed.pth").write_text(f"{layer}\n")
    install = subprocess.run(
        [*pip, "install", "-q", "-c", str(constraints), target],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-5000:]
    checked = subprocess.run([*pip, "check"], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    prepared = run_fresh(venv, "textsql", "prepare", "--data-dir", str(tmp_path / "data"), "--limit", "8")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert (tmp_path / "data" / "prepare.json").is_file()
    imported = run_fresh(venv, "python", "-c", "import kubernetes.client, s3fs, dateutil; print(dateutil.__version__)")
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.strip() == pins["python-dateutil"]
