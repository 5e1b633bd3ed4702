"""What an executed notebook shows a person, and a finished demo's run as a test reads it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat


@dataclass(frozen=True)
class FinishedDemo:
    """A demo that ran to its end: its run directory, what its command printed, its notebooks' records."""

    run_dir: Path
    terminal: subprocess.CompletedProcess[str]
    records: dict[str, dict[str, Any]]

    def parameter(self, notebook: str, name: str) -> Any:
        """The value ``notebook`` ran with for its parameter ``name``."""
        return self.records[notebook]["parameters"][name]


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
