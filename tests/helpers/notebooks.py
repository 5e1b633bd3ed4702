"""What an executed notebook shows a person."""

from __future__ import annotations

import nbformat


def output_lines(notebook: nbformat.NotebookNode) -> list[str]:
    """Every line a person scrolls past in a notebook's outputs: its streams, and each display's text.

    :rtype: list[str]
    """
    return [
        line
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        for line in (output.get("text") or output.get("data", {}).get("text/plain", "")).splitlines()
    ]
