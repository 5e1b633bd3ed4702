"""mkdocs hook: the package's Sphinx-style cross-reference roles, shown as plain code on the API page.

The docstrings follow the house style (``:class:`Predictor```, ``:func:`train_argv```); mkdocstrings'
Sphinx parser reads their ``:param:`` fields but leaves the roles in the text, where they would show as
``:class:`` before the name.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return ROLE.sub("", html)
