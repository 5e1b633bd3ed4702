"""mkdocs hook: each backend's ``backend_options`` table, generated from the code.

A page that holds ``<!-- backend-options: NAME -->`` gets a table of backend ``NAME``'s options, each with its
default and meaning: the ``kubernetes`` and ``slurm`` backends' are the fields of their options class
(:class:`~worker.backends.kubernetes_options.KubernetesOptions`, :class:`~worker.backends.slurm_options.SlurmOptions`)
with their attribute docstrings, the others' their constructor's keyword arguments with its ``:param:`` lines (what :meth:`~worker.backends.base.Backend.from_options`
accepts). So the site cannot list another option or default than the backend takes. A description's
``:data:`NAME``` role is written as that constant's value, so a table never shows the code's internal names.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"<!-- backend-options: (\w+) -->")
# What a test hands a backend instead of the platform's own client: no option a notebook sets.
CLIENTS = ("api", "networking_api")
# The backends whose ``from_options`` takes the fields of an options dataclass, not its constructor's arguments.
OPTIONS_CLASSES = {
    "kubernetes": "worker.backends.kubernetes_options:KubernetesOptions",
    "slurm": "worker.backends.slurm_options:SlurmOptions",
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARKER.sub(lambda found: options_table(found.group(1)), markdown)


def options_table(backend: str) -> str:
    """The markdown table of backend ``backend``'s options.

    :raises PluginError: for a backend that does not exist, or an option without a description.
    """
    rows = []
    for name, default, meaning in backend_options(backend):
        if not meaning:
            raise PluginError(f"the {backend!r} backend's option {name!r} has no description in the code")
        shown = "required" if default is inspect.Parameter.empty else f"`{default!r}`"
        rows.append(f"| `{name}` | {shown} | {cell(meaning)} |")
    return "\n".join(["| option | default | meaning |", "| --- | --- | --- |", *rows])


def backend_options(backend: str) -> Iterator[tuple[str, Any, str]]:
    """(name, default or ``inspect.Parameter.empty``, description) of each option of backend ``backend``."""
    from worker.backends import BACKENDS

    if backend not in BACKENDS:
        raise PluginError(f"<!-- backend-options: {backend} -->: no such backend; choose one of {', '.join(BACKENDS)}")
    module, name = BACKENDS[backend].split(":")
    cls = getattr(importlib.import_module(module), name)
    if backend in OPTIONS_CLASSES:  # its from_options takes the fields of its options class
        module, name = OPTIONS_CLASSES[backend].split(":")
        options = getattr(importlib.import_module(module), name)
        described = attribute_docstrings(options)
        for field in dataclasses.fields(options):
            default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
            yield field.name, default, constants_shown(described.get(field.name, ""), vars(sys.modules[module]))
        return
    described = parameter_docs(inspect.getdoc(cls.__init__) or "")
    for parameter in inspect.signature(cls.__init__).parameters.values():
        if parameter.name != "self" and parameter.name not in CLIENTS:
            yield (
                parameter.name,
                parameter.default,
                constants_shown(described.get(parameter.name, ""), vars(sys.modules[module])),
            )


def constants_shown(text: str, namespace: dict[str, Any]) -> str:
    """``text`` with each ``:data:`NAME``` role written as the constant's value: a reader sees the values, never the
    code's internal name (a collection as its sorted items, each in backticks).

    :raises PluginError: for a role naming no constant of ``namespace`` (the backend's module).
    """

    def value(found: re.Match[str]) -> str:
        name = found.group(1).rpartition(".")[2]
        if name not in namespace:
            raise PluginError(f"an option's description names :data:`{found.group(1)}`, which its module lacks")
        constant = namespace[name]
        if isinstance(constant, set | frozenset | list | tuple):
            return ", ".join(f"`{item}`" for item in sorted(constant))
        return f"`{constant!r}`"

    return re.sub(r":data:`~?([^`]+)`", value, text)


def attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls``'s body (what mkdocstrings shows)."""
    (body,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(body, ast.ClassDef)
    found = {}
    for node, following in zip(body.body, body.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            found[node.target.id] = inspect.cleandoc(following.value.value)
    return found


def parameter_docs(docstring: str) -> dict[str, str]:
    """``:param name: text`` fields of a Sphinx docstring (continuation lines indented), by name."""
    fields = re.findall(r"^:param (\w+):(.*(?:\n[ \t]+.*)*)", docstring, re.MULTILINE)
    return {name: " ".join(text.split()) for name, text in fields}


def cell(text: str) -> str:
    """Docstring text as one markdown table cell: roles as code, no ``|`` or newline to end it early."""
    text = re.sub(r":(?:class|func|meth|mod|data|attr):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")
