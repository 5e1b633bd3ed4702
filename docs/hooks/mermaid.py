"""mkdocs hook: Mermaid drawings drawn in the reader's browser by a copy of Mermaid that the site carries.

Material draws a ``mermaid`` fence with the page's global ``mermaid`` when one is defined, and otherwise
fetches ``mermaid@11`` from unpkg.com, which a site that loads nothing from the network cannot do. This hook
copies the Mermaid 11 that the PyPI package ``mermaidx`` ships (``mermaidx/assets/mermaid.js``, a script that
sets ``window.mermaid``; pinned in requirements-dev.txt) into the site, and loads it in the ``<head>`` of each
page that has a drawing, before Material's bundle looks for it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url

DISTRIBUTION = "mermaidx"
SHIPPED = "mermaidx/assets/mermaid.js"
SITE_PATH = "javascripts/mermaid.js"
# What pymdownx.superfences writes for a ``mermaid`` fence (mkdocs.yml's custom_fences).
DRAWING = '<pre class="mermaid">'


def mermaid_script() -> Path:
    """The Mermaid script the installed ``mermaidx`` ships, found without importing the package."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PluginError(f"{DISTRIBUTION} is not installed: pip install -r requirements-dev.txt") from None
    script = Path(str(distribution.locate_file(SHIPPED)))
    if not script.is_file():
        raise PluginError(
            f"{DISTRIBUTION} {distribution.version} ships no {SHIPPED}: pin the version in requirements-dev.txt"
        )
    return script


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, SITE_PATH, abs_src_path=str(mermaid_script())))
    return files


def on_post_page(output: str, page: Any, config: Any) -> str:
    if DRAWING not in output:
        return output
    script = f'<script src="{get_relative_url(SITE_PATH, page.url)}"></script>'
    return output.replace("</head>", f"{script}\n</head>", 1)
