"""The architecture kept by tools: the import contracts (pyproject.toml's [tool.importlinter]), the size of modules
and functions, what each package's docstring says it holds, and how many modules the package's top level has.

Everything is found by walking the packages the contracts name, so a module split or added is covered at once.
"""

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers.paths import PROJECT_DIR

IMPORT_LINTER = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = tuple(IMPORT_LINTER["root_packages"])
# The size rules hold for the library, the worker side and the benchmarks (CONTRIBUTING.md, "Conventions").
SIZED_TREES = (*PACKAGES, "bench")
MODULE_LINES = 400
FUNCTION_LINES = 60
# A module may be longer when its docstring's first paragraph says why, in a sentence that starts so.
LONGER_BECAUSE = "Longer than 400 lines because"
TOP_LEVEL_MODULES = 10


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
    assert f"Contracts: {len(IMPORT_LINTER['contracts'])} kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, wrong_import, broken",
    [
        ("worker/hostfile.py", "from textsql.errors import DataError", "worker.hostfile -> textsql.errors"),
        # textsql's packages by layer: no package imports one above it ...
        ("textsql/data/sql.py", "import textsql.inference", "textsql.data.sql -> textsql.inference"),
        ("textsql/training/loss.py", "import textsql.launching", "textsql.training.loss -> textsql.launching"),
        ("textsql/display/step_bar.py", "import textsql.launching", "textsql.display.step_bar -> textsql.launching"),
        # ... nor one beside it in its layer: training and inference (stages 3 and 4) never import each other.
        ("textsql/training/loss.py", "import textsql.inference", "textsql.training.loss -> textsql.inference"),
        ("textsql/inference/guidance.py", "import textsql.training", "textsql.inference.guidance -> textsql.training"),
        # No cycle between the modules of one package (acyclic_siblings), imports for type checking included.
        (
            "textsql/scoring/engine.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from textsql.scoring.evaluate import evaluate",
            "No cycles are allowed in textsql.scoring.",
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
        # and every module has a layer: a new one that has none breaks the exhaustive contracts.
        ("worker/newcomer.py", "import worker.errors", "- worker.newcomer"),
        ("textsql/newcomer.py", "import textsql.errors", "- textsql.newcomer"),
    ],
)
def test_an_import_going_the_wrong_way_breaks_a_contract(tmp_path, module, wrong_import, broken):
    """The contracts are not vacuous: a copy of the tree with one import the wrong way fails them."""
    copy_tree(tmp_path)
    path = tmp_path / module
    path.write_text((path.read_text() if path.exists() else "") + f"\n{wrong_import}  # the wrong way\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert broken in result.stdout and " broken" in result.stdout


# One wrong import from each package of the master side into the rank program, planted in one copy of the tree.
MASTER_INTO_RANK = {
    "textsql/cli/options.py": "import textsql.training.batching",
    "textsql/pipeline/runs.py": "from textsql.training.output_dir import export_model",
    "textsql/launching/recovery.py": "import textsql.training.mark_complete",
    "textsql/store/sync.py": "import textsql.training",
}


def test_the_master_side_importing_the_rank_program_breaks_a_contract(tmp_path):
    """cli, pipeline, launching and store plan with textsql.planning and read runs with textsql.rundir: an import
    of textsql.training from any of them (but the `train` command's own entry point) breaks the forbidden contract."""
    copy_tree(tmp_path)
    for module, wrong_import in MASTER_INTO_RANK.items():
        path = tmp_path / module
        path.write_text(path.read_text() + f"\n{wrong_import}  # the wrong way\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "never imports the rank program (training) BROKEN" in " ".join(result.stdout.split())
    for module in MASTER_INTO_RANK:
        importer = module.removesuffix(".py").replace("/", ".")
        assert f"{importer} -> textsql.training" in result.stdout, result.stdout


def copy_tree(destination: Path) -> None:
    """The packages and pyproject.toml, without the model assets, for lint-imports to run over."""
    for name in (*PACKAGES, "pyproject.toml"):
        source = PROJECT_DIR / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=shutil.ignore_patterns("assets", "__pycache__"))
        else:
            shutil.copy(source, destination / name)


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


def python_files(*trees: str) -> list[Path]:
    return sorted(path for tree in trees for path in (PROJECT_DIR / tree).rglob("*.py") if "assets" not in path.parts)


def explains_its_length(tree: ast.Module) -> bool:
    first_paragraph = (ast.get_docstring(tree) or "").split("\n\n", 1)[0]
    return LONGER_BECAUSE in " ".join(first_paragraph.split())


def function_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From the ``def`` line to the last line of the body, the docstring's lines left out."""
    assert function.end_lineno is not None
    lines = function.end_lineno - function.lineno + 1
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


def size_offences(path: Path) -> list[str]:
    """What in one module breaks the size rules, each offence on a line that names where it is."""
    source = path.read_text()
    tree = ast.parse(source, str(path))
    name = path.relative_to(PROJECT_DIR)
    lines = len(source.splitlines())
    offences = []
    if lines > MODULE_LINES and not explains_its_length(tree):
        offences.append(
            f"{name}: {lines} lines, over {MODULE_LINES}: split it by job, or say why in its docstring's first "
            f"paragraph ({LONGER_BECAUSE} ...)"
        )
    offences += [
        f"{name}:{node.lineno} {node.name}: {function_lines(node)} lines, over {FUNCTION_LINES} (docstring left out)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and function_lines(node) > FUNCTION_LINES
    ]
    return offences


@pytest.mark.parametrize("module", sorted(str(path.relative_to(PROJECT_DIR)) for path in python_files(*SIZED_TREES)))
def test_modules_and_functions_are_short(module):
    """Modules of at most 400 lines (or a reason given), functions of at most 60 (CONTRIBUTING.md)."""
    offences = size_offences(PROJECT_DIR / module)
    assert not offences, "\n".join(offences)


def subpackages() -> list[Path]:
    """Every package below the root packages, as its directory."""
    return sorted(
        init.parent
        for package in PACKAGES
        for init in (PROJECT_DIR / package).rglob("__init__.py")
        if init.parent.name != package
    )


def package_modules(directory: Path) -> set[str]:
    """The modules and subpackages directly in a package, by their short names."""
    modules = {path.stem for path in directory.glob("*.py") if path.stem != "__init__"}
    return modules | {path.parent.name for path in directory.glob("*/__init__.py")}


def defined_names(directory: Path) -> set[str]:
    """The names a package's modules define or import at their top level."""
    names = set()
    for path in directory.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


@pytest.mark.parametrize("directory", subpackages(), ids=lambda directory: str(directory.relative_to(PROJECT_DIR)))
def test_each_package_docstring_names_its_modules(directory):
    """A package's docstring is its map: each module in ``double backticks``, and no module that is gone. A
    name in double backticks that is no module must be one the package defines (``cli``), or a root package."""
    dotted = ".".join(directory.relative_to(PROJECT_DIR).parts)
    docstring = ast.get_docstring(ast.parse((directory / "__init__.py").read_text())) or ""
    named = {name.removeprefix(f"{dotted}.") for name in re.findall(r"``([^`]+)``", docstring)}
    modules = package_modules(directory)
    unnamed = sorted(modules - named)
    assert not unnamed, f"{dotted}'s docstring does not name its modules {unnamed} in ``double backticks``"
    identifiers = {name for name in named if re.fullmatch(r"[A-Za-z_]\w*", name)}
    stale = sorted(identifiers - modules - defined_names(directory) - set(PACKAGES))
    assert not stale, f"{dotted}'s docstring names {stale}: no module of it, nor a name it defines"


def test_the_top_level_of_textsql_stays_small():
    """New modules go into the subpackage of their stage; the top level keeps what every stage shares."""
    top_level = sorted(path.name for path in (PROJECT_DIR / "textsql").glob("*.py"))
    assert len(top_level) <= TOP_LEVEL_MODULES, f"{len(top_level)} modules at textsql/'s top level: {top_level}"


def test_the_bench_docstring_sorts_every_module_into_its_kind():
    """bench/__init__.py is the bench's map (figures, measured arms, server stand-ins, shared helpers): each module
    named there in ``double backticks``, and no module that is gone."""
    docstring = ast.get_docstring(ast.parse((PROJECT_DIR / "bench" / "__init__.py").read_text())) or ""
    named = set(re.findall(r"``([a-z_]+)``", docstring))
    modules = {path.stem for path in (PROJECT_DIR / "bench").glob("*.py")} - {"__init__", "__main__"}
    assert sorted(modules - named) == [], "bench modules missing from bench/__init__.py's map"
    assert sorted(named - modules) == [], "bench/__init__.py names modules that are gone"
