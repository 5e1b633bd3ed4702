"""mkdocs hook: the architecture page's maps, generated from pyproject.toml and the packages themselves.

On a page that holds them, ``<!-- architecture-layers -->`` becomes a Mermaid drawing of each container of each
``layers`` contract of ``[tool.importlinter]``, the contracts lint-imports checks (so a drawing cannot show another
order than the check enforces), and ``<!-- architecture-modules -->`` a table for each package of the contracts'
``root_packages``, found by walking them: its modules and subpackages, each with the first sentence of its
docstring, a layered package's parts in the order of its layers. A module without a docstring fails the build,
and so does a dotted name of those packages in the page's own text (``textsql.launching.supervisor``) that names
no module.
"""

from __future__ import annotations

import ast
import itertools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

LAYERS_MARKER = "<!-- architecture-layers -->"
MODULES_MARKER = "<!-- architecture-modules -->"
# import-linter's layer syntax: "a | b" are independent siblings, "a : b" siblings that may import each other,
# "(a)" a layer that may be absent.
SIBLINGS = re.compile(r"\s*[|:]\s*")
# The end of a docstring's first sentence: a full stop before a space or the end, not the one in "e.g." or "i.e.".
SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)\.(?=\s|$)")


@dataclass(frozen=True)
class Module:
    """One module or package of the project: its dotted name, its file and whether it is a package."""

    name: str
    path: Path
    is_package: bool

    @property
    def parent(self) -> str:
        return self.name.rpartition(".")[0]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if LAYERS_MARKER not in markdown and MODULES_MARKER not in markdown:
        return markdown
    root = Path(config["config_file_path"]).parent
    linter = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    modules = {module.name: module for package in linter["root_packages"] for module in walk(root, package)}
    unknown = sorted(set(dotted_names(markdown, linter["root_packages"])) - set(modules))
    if unknown:
        raise PluginError(f"{page.file.src_path} names what the packages do not have: {', '.join(unknown)}")
    layered = layers_by_container(linter["contracts"])
    markdown = markdown.replace(LAYERS_MARKER, contract_drawings(linter["contracts"]))
    return markdown.replace(MODULES_MARKER, module_tables(modules, layered))


def walk(root: Path, package: str) -> list[Module]:
    """Every module and package of ``package`` (a directory of ``root``), packages being directories with an
    ``__init__.py``, in the order of their names."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if not all((root.joinpath(*parts[:depth]) / "__init__.py").is_file() for depth in range(1, len(parts))):
            continue  # a script among a package's data files, not a module
        is_package = parts[-1] == "__init__"
        found.append(Module(".".join(parts[:-1] if is_package else parts), path, is_package))
    return sorted(found, key=lambda module: module.name)


def summary(module: Module) -> str:
    """The first sentence of the module's docstring, on one line, safe in a table cell."""
    docstring = ast.get_docstring(ast.parse(module.path.read_text()))
    if not docstring:
        raise PluginError(f"{module.path} has no docstring: its first sentence says the module's job")
    paragraph = " ".join(docstring.split("\n\n", 1)[0].split())
    end = SENTENCE_END.search(paragraph)
    sentence = paragraph[: end.end()] if end else paragraph
    return sentence.replace("|", "\\|")


def dotted_names(markdown: str, packages: list[str]) -> list[str]:
    """The dotted names of ``packages`` in the page's own text (``worker.cluster``), a file name's (``.py``) left out."""
    pattern = re.compile(rf"\b(?:{'|'.join(map(re.escape, packages))})(?:\.[A-Za-z_]\w*)+")
    return [match.group(0) for match in pattern.finditer(markdown) if not markdown.startswith(".py", match.end())]


def contract_drawings(contracts: list[dict[str, Any]]) -> str:
    """A drawing for each ``layers`` contract, then a line for each contract of another type."""
    drawings = [
        drawing for contract in contracts if contract["type"] == "layers" for drawing in layer_drawings(contract)
    ]
    others = [
        f"- **{contract['name']}** (`{contract['type']}`)" for contract in contracts if contract["type"] != "layers"
    ]
    return "\n\n".join([*drawings, "\n".join(others)])


def layer_names(layer: str) -> list[str]:
    return [name.strip("()") for name in SIBLINGS.split(layer.strip()) if name]


def layers_by_container(contracts: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    """Each layered container's layers, top first, each layer's names as the contract writes them."""
    return {
        container: [layer_names(layer) for layer in contract["layers"]]
        for contract in contracts
        if contract["type"] == "layers"
        for container in contract.get("containers", [])
    }


def node_id(name: str) -> str:
    return "m_" + re.sub(r"\W", "_", name)


def layer_drawings(contract: dict[str, Any]) -> list[str]:
    """A ``layers`` contract as one Mermaid flowchart per container: its layers top to bottom, numbered as the
    tables below number them, each layer's parts side by side, an arrow from each layer to the next (it may
    import what is below)."""
    layers = [layer_names(layer) for layer in contract["layers"]]
    drawings = []
    for container in contract.get("containers", [""]):
        title = f"{contract['name']}" + (f" (`{container}`)" if len(contract.get("containers", [])) > 1 else "")
        lines = [f"**{title}**", "", "```mermaid", "flowchart TB"]
        layer_ids = [node_id(f"{container}:layer {number}") for number in range(1, len(layers) + 1)]
        parts = [[node_id(f"{container}.{name}") for name in names] for names in layers]
        for number, (layer_id, names, ids) in enumerate(zip(layer_ids, layers, parts, strict=True), 1):
            lines.append(f'  subgraph {layer_id} ["layer {number}"]')
            lines += [f'    {part_id}["{name}"]' for part_id, name in zip(ids, names, strict=True)]
            lines.append("  end")
        lines += [f"  {upper} --> {lower}" for upper, lower in itertools.pairwise(layer_ids)]
        # Invisible links from every part of a layer to every part of the next put a layer's parts in one row.
        lines += [
            f"  {upper} ~~~ {lower}" for above, below in itertools.pairwise(parts) for upper in above for lower in below
        ]
        drawings.append("\n".join([*lines, "```"]))
    return drawings


def module_tables(modules: dict[str, Module], layered: dict[str, list[list[str]]]) -> str:
    """One table per package: its modules and subpackages with their jobs; a layered package's parts by layer."""
    sections = []
    for package in [name for name, module in modules.items() if module.is_package]:
        children = [module for module in modules.values() if module.parent == package]
        layers = layered.get(package)
        if layers:
            position = {f"{package}.{name}": index for index, layer in enumerate(layers, 1) for name in layer}
            children.sort(key=lambda child: (position.get(child.name, len(layers) + 1), child.name))
            rows = [f"| {position.get(child.name, '?')} | {part(child)} | {summary(child)} |" for child in children]
            table = ["| layer | part | job |", "| --- | --- | --- |", *rows]
        else:
            table = [
                "| part | job |",
                "| --- | --- |",
                *(f"| {part(child)} | {summary(child)} |" for child in children),
            ]
        sections.append("\n".join([f"### `{package}`", "", summary(modules[package]), "", *table]))
    return "\n\n".join(sections)


def part(module: Module) -> str:
    return f"`{module.name}`" + (" (package)" if module.is_package else "")
