"""mkdocs hook: the site's Contributing page is the repository's CONTRIBUTING.md, generated from it at build time.

One text serves both readers: the repository's (links relative to its root) and the site's. A link into
``docs/`` becomes the site's own link; a link to another file of the repository (``CHANGELOG.md``, ``LICENSE``),
which the site does not carry, becomes the file's name in code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

PAGE = "contributing.md"
LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")


def site_link(link: re.Match[str]) -> str:
    target = link["target"]
    if "://" in target or target.startswith(("#", "mailto:")):
        return link.group(0)
    if target.startswith("docs/"):
        return f"[{link['text']}]({target.removeprefix('docs/')})"
    return f"{link['text']} (`{target}` in the repository)"


def on_files(files: Files, config: Any) -> Files:
    source = Path(config["docs_dir"]).parent / "CONTRIBUTING.md"
    files.append(File.generated(config, PAGE, content=LINK.sub(site_link, source.read_text())))
    return files
