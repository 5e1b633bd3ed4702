"""The architecture kept by tools: import contracts (pyproject.toml's [tool.importlinter])."""
import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path


from conftest import PROJECT_DIR

PACKAGES = ("textsql", "worker")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    executable = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    return subprocess.run([executable, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_import_contracts_hold():
    result = lint_imports(PROJECT_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 1 kept, 0 broken" in result.stdout


def test_an_import_from_worker_into_textsql_breaks_the_contract(tmp_path):
    """The contract is not vacuous: a copy of the tree where worker imports textsql fails it."""
    for name in (*PACKAGES, "pyproject.toml"):
        source = PROJECT_DIR / name
        copy = shutil.copytree if source.is_dir() else shutil.copy
        copy(source, tmp_path / name, **({"ignore": shutil.ignore_patterns("assets", "__pycache__")} if source.is_dir() else {}))
    hostfile = tmp_path / "worker" / "hostfile.py"
    hostfile.write_text(hostfile.read_text() + textwrap.dedent("""
        from textsql.errors import DataError  # the wrong way
    """))
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "worker.hostfile -> textsql.errors" in result.stdout


def test_no_module_imports_a_private_name_of_another():
    offenders = []
    for package in PACKAGES:
        for path in sorted((PROJECT_DIR / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    offenders += [f"{path.relative_to(PROJECT_DIR)}: {node.module}.{alias.name}"
                                  for alias in node.names if alias.name.startswith("_")]
    assert offenders == []
