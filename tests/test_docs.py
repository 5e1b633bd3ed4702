"""The documentation site builds offline with ``--strict``, and its generated pages say what the code says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import click
import papermill
import pytest
from helpers.doc_blocks import page_blocks, ran
from helpers.docs import NEEDS, SHELL_WORDS, SYSTEM_PROGRAMS, commands, parse, program, shell_blocks

from textsql.cli import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# GitHub shows a README's first screen; past about 8 KB it is a manual, and the manual is the site.
README_LIMIT_BYTES = 8192
ROOT_PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
CHROMIUM = shutil.which("chromium")
PROSE = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr[-4000:]}"
    return out


def command_paths(group: click.Group, prefix: tuple[str, ...] = ("textsql",)) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        yield (*prefix, name)
        if isinstance(command, click.Group):
            yield from command_paths(command, (*prefix, name))


def command_at(path: tuple[str, ...]) -> click.Command:
    command: click.Command = cli
    for name in path[1:]:
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return command


def test_the_cli_reference_has_every_subcommand_and_option(site: Path) -> None:
    page = (site / "reference" / "cli.html").read_text()
    paths = list(command_paths(cli))
    assert len(paths) >= 10
    missing = [" ".join(path) for path in paths if f'id="{"-".join(path)}"' not in page]
    assert not missing, f"no section on the CLI reference page for: {missing}"
    undocumented = [
        f"{' '.join(path)} {option}"
        for path in paths
        for parameter in command_at(path).params
        if isinstance(parameter, click.Option) and not parameter.hidden
        for option in parameter.opts
        if option.startswith("--") and option not in page
    ]
    assert not undocumented, f"options missing from the CLI reference page: {undocumented}"


def test_the_notebooks_page_lists_every_parameter_with_its_default(site: Path) -> None:
    page = (site / "notebooks.html").read_text()
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        section = page.split(f'id="{notebook.stem}"', 1)
        assert len(section) == 2, f"no parameter table for {notebook.name}"
        table = section[1].split("</table>", 1)[0]
        for name in papermill.inspect_notebook(str(notebook)):
            assert f"<code>{name}</code>" in table, f"{notebook.name}'s parameter {name} is not in its table"


def package_modules() -> list[str]:
    """The dotted name of every package and module of the root packages, found by walking them."""
    names = []
    for package in ROOT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if all((ROOT.joinpath(*parts[:depth]) / "__init__.py").is_file() for depth in range(1, len(parts))):
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_architecture_page_has_every_package_and_module_and_each_layered_package(site: Path) -> None:
    page = (site / "explanation" / "architecture.html").read_text()
    names = package_modules()
    assert len(names) > 50
    missing = [name for name in names if f"<code>{name}</code>" not in page]
    assert not missing, f"not on the architecture page: {missing}"
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = [
        container
        for contract in contracts
        if contract["type"] == "layers"
        for container in contract.get("containers", [""])
    ]
    assert page.count('<pre class="mermaid">') > len(layered), "a drawing per layered package, and one of a run"


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM, reason="Debian's chromium is absent; run scripts/setup-system.sh --dev")
def test_the_architecture_drawings_are_drawn_without_the_network(site: Path, tmp_path: Path) -> None:
    """Material draws a drawing with the Mermaid the site carries (docs/hooks/mermaid.py), or fetches one from a CDN,
    which this browser cannot reach: every host name fails to resolve."""
    page = site / "explanation" / "architecture.html"
    drawings = page.read_text().count('<pre class="mermaid">')
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
    browser += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    browser += [f"--user-data-dir={tmp_path}", "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=30000"]
    shown = subprocess.run(
        [*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180, check=True
    )
    # Material replaces each drawing's <pre> by a <div class="mermaid"> holding the drawing once Mermaid drew it.
    assert shown.stdout.count('<div class="mermaid">') == drawings, shown.stderr[-2000:]


def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    remote = re.compile(r"""<(?:link|script|img)\b[^>]*\b(?:href|src)=["'](?:https?:)?//""")
    offenders = [
        f"{page.relative_to(site)}: {match.group(0)}"
        for page in site.rglob("*.html")
        for match in remote.finditer(page.read_text())
    ]
    assert not offenders, offenders[:5]


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_bytes()) <= README_LIMIT_BYTES, "README.md grew past a front page: move detail to docs/"


def test_relative_links_in_the_top_level_documents_resolve() -> None:
    broken = [
        f"{document.name}: {target}"
        for document in (README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text())
        if "://" not in target and not target.startswith("mailto:") and not (document.parent / target).exists()
    ]
    assert not broken, broken


def test_the_documents_cite_no_tracker_numbers() -> None:
    # A reader has no tracker: "issue 25's first pass" says nothing to them.
    cited = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in PROSE
        for match in re.finditer(r"\bissues? #?\d+", path.read_text(), re.IGNORECASE)
    ]
    assert not cited, cited


def master_private_names() -> set[str]:
    """The file names the code keeps in a run's master-private directory: ``master_dir(...) / NAME`` anywhere in
    textsql/, NAME a string or a constant of textsql.constants or the module's own."""
    import ast

    import textsql.constants

    names = set()
    for path in (ROOT / "textsql").rglob("*.py"):
        tree = ast.parse(path.read_text())
        local = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
                continue
            call = node.left
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "master_dir":
                right = node.right
                if isinstance(right, ast.Constant):
                    names.add(right.value)
                elif isinstance(right, ast.Name):
                    names.add(local.get(right.id) or getattr(textsql.constants, right.id))
    return names


def test_the_security_pages_trust_table_names_what_the_code_keeps_private() -> None:
    """Every file the master keeps to itself is on the page's private side, and the page claims no other."""
    page = (ROOT / "docs" / "explanation" / "security.md").read_text()
    table = page.split("## What the master keeps to itself", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `")]
    private = {
        name for cells in rows if cells[1].strip() == "master-private" for name in re.findall(r"`([^`]+)`", cells[0])
    }
    assert private == master_private_names()


def pymarkdown(*pages: Path) -> subprocess.CompletedProcess[str]:
    """pymarkdown over ``pages`` with the project's settings (``[tool.pymarkdown]`` in pyproject.toml)."""
    return subprocess.run(
        [sys.executable, "-m", "pymarkdown", "--strict-config", "scan", *map(str, pages)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_markdown_pages_pass_the_linter() -> None:
    linted = pymarkdown(*PROSE)
    assert linted.returncode == 0, linted.stdout[-4000:] + linted.stderr[-2000:]


def test_the_linter_refuses_a_list_that_would_render_as_a_paragraph(tmp_path: Path) -> None:
    """Without a blank line above it, a list is one paragraph of dashes on the site (Python-Markdown), and
    ``mkdocs build --strict`` says nothing."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\nWhat a continuation does:\n- skips what completed;\n- relaunches training.\n")
    linted = pymarkdown(page)
    assert linted.returncode != 0 and "MD032" in linted.stdout, linted.stdout + linted.stderr
    page.write_text(page.read_text().replace(":\n-", ":\n\n-"))
    linted = pymarkdown(page)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def documented_tools() -> dict[str, click.Command]:
    """The click programs whose command lines the pages give, by the name a reader types."""
    from huggingface_hub.cli.hf import app as hf
    from mlflow.cli import cli as mlflow
    from papermill.cli import papermill as papermill_cli

    return {"textsql": cli, "hf": hf, "mlflow": mlflow, "papermill": papermill_cli}


def test_every_documented_command_line_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``textsql``, ``hf``, ``mlflow`` and ``papermill`` command of a page's shell blocks (those that need a
    hub or a cluster included) parses with the installed program: a missing required option, an unknown or
    renamed one, or a bad value fails here. Parsed, not run: nothing is called."""
    for name in [name for name in os.environ if name.startswith("TEXTSQL_")]:
        monkeypatch.delenv(name)  # an option's variable would stand in for a missing option
    tools = documented_tools()
    checked, failures = 0, []
    for block in shell_blocks(PROSE):
        for words in commands(block.text):
            if program(words) not in tools:
                continue
            checked += 1
            try:
                parse(tools[program(words)], program(words), words[1:])
            except click.ClickException as error:
                failures.append(f"{block}: {' '.join(words)}\n    {type(error).__name__}: {error.format_message()}")
    assert not failures, "\n".join(failures)
    assert checked >= 12, f"only {checked} command lines found: is the block extraction broken?"


def test_the_command_line_check_sees_a_missing_option_and_a_renamed_one() -> None:
    with pytest.raises(click.MissingParameter) as missing:
        parse(cli, "textsql", ["launch", "--hostfile", "hosts", "--min-workers", "1", "--", "--profile", "zero1"])
    assert "--run-dir" in missing.value.format_message()
    with pytest.raises(click.NoSuchOption):
        parse(cli, "textsql", ["workers", "cleanup", "--namespace", "ml", "--run-id", "ID"])


def test_a_block_marked_as_needing_something_names_a_known_need() -> None:
    marked = [block for block in shell_blocks(PROSE) if block.needs]
    assert {block.needs for block in marked} >= {"hub", "cluster"}
    unknown = [f"{block}: {block.needs}" for block in marked if block.needs not in NEEDS]
    assert not unknown, f"needs one of {sorted(NEEDS)}: {unknown}"


def test_every_program_a_page_runs_is_installed_with_the_project() -> None:
    """A page runs the project's programs from its virtual environment (``.venv/bin/NAME``, what `make setup-dev`
    installs from the pinned requirements) or a few from the system; a program no pinned package installs fails
    (huggingface_hub installs ``hf``, not ``huggingface-cli``)."""
    venv_bin = Path(sys.executable).parent
    missing = [
        f"{block}: {words[0]}"
        for block in shell_blocks(PROSE)
        for words in commands(block.text)
        if words[0] not in SHELL_WORDS | SYSTEM_PROGRAMS and not (venv_bin / program(words)).exists()
    ]
    assert not missing, missing


@pytest.mark.slow
def test_the_serving_guides_local_check_answers_from_the_model_it_names(reader_project: Path) -> None:
    """The serving page's block, as tests/test_docs_blocks.py runs it after `make demo` (once a session, in the
    reader's copy): a query comes back from the demo's model, not "no model to serve"."""
    (block,) = [
        block for block in page_blocks(ROOT / "docs" / "guides" / "serving.md") if "model.py" in block.parsed.text
    ]
    assert "TEXTSQL_MODEL_DIR=runs/demo/model" in block.parsed.text, f"{block.parsed} names no model to serve"
    answered = ran(block, reader_project)
    assert "'sql': 'SELECT " in answered.stdout and "error" not in answered.stdout, (
        answered.stdout + answered.stderr[-2000:]
    )
