"""mkdocs hook: the notebooks' parameter tables, generated from each notebook's ``parameters`` cell.

A page that holds ``<!-- notebook-parameters -->`` gets one table per ``notebooks/*.ipynb``, read with
papermill's own ``inspect_notebook`` (what ``papermill --help-notebook`` prints), so the site cannot say
another default than the notebook does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import papermill
from mkdocs.exceptions import PluginError

MARKER = "<!-- notebook-parameters -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    notebooks = sorted((Path(config["docs_dir"]).parent / "notebooks").glob("*.ipynb"))
    if not notebooks:
        raise PluginError(f"{MARKER} on {page.file.src_path}: no notebooks/*.ipynb next to docs/")
    return markdown.replace(MARKER, "\n\n".join(parameter_table(path) for path in notebooks))


def parameter_table(notebook: Path) -> str:
    parameters = papermill.inspect_notebook(str(notebook))
    if not parameters:
        raise PluginError(f"{notebook.name} has no cell tagged 'parameters'")
    rows = [
        f"| `{name}` | {spec['inferred_type_name']} | `{spec['default']}` | {cell(spec['help'])} |"
        for name, spec in parameters.items()
    ]
    header = ["| parameter | type | default | meaning |", "| --- | --- | --- | --- |"]
    return "\n".join([f"### `{notebook.stem}`", "", *header, *rows])


def cell(text: str) -> str:
    """Help text as one markdown table cell: its ``|`` would end the cell, a newline the row."""
    return text.replace("|", "\\|").replace("\n", " ")
