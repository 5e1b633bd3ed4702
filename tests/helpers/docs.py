"""The shell blocks of the Markdown pages, what each needs that a test machine lacks, and their command lines.

A block that needs something this machine lacks carries a mark just above its fence, invisible on the site:
``<!-- needs: hub -->`` (see :data:`NEEDS`). Its commands are still parsed, only never run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click

from helpers.paths import PROJECT_DIR

NEEDS = {
    "hub": "the Hugging Face hub (a network)",
    "gpu": "a CUDA GPU",
    "cluster": "hosts, a cluster or a tracking server to launch on, or a deployed model",
    "docker": "Docker, to build the image",
}
# What a page may run from the system rather than from the project's .venv/bin (tests/test_docs.py).
SYSTEM_PROGRAMS = {"make", "grep", "bash", "curl", "docker", "pip", "python", "kubectl"}
SHELL_WORDS = {"export", "for", "do", "done", "break", "cd"}
SHELLS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(
    r"^(?P<indent> *)(?P<fence>```+|~~~+) *(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)(?P=fence) *$",
    re.MULTILINE | re.DOTALL,
)
NEEDS_MARK = re.compile(r"<!-- needs: (?P<what>[a-z]+) -->\n\n?$")
OPERATORS = {";", "&&", "||", "|", "&"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    """One shell block of a page: where it is, its text, and what it needs (``None``: it runs here)."""

    page: Path
    line: int
    text: str
    needs: str | None

    def __str__(self) -> str:
        return f"{self.page.relative_to(PROJECT_DIR)}:{self.line}"


def shell_blocks(pages: list[Path]) -> list[Block]:
    """Every fenced ``bash``/``sh``/``shell``/``console`` block of ``pages``, in order."""
    blocks = []
    for page in pages:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            if fence.group("lang") not in SHELLS:
                continue
            mark = NEEDS_MARK.search(text, 0, fence.start())
            indent = len(fence.group("indent"))
            body = "".join(line[indent:] for line in fence.group("body").splitlines(keepends=True))
            line = text.count("\n", 0, fence.start()) + 1
            blocks.append(Block(page, line, body, mark.group("what") if mark else None))
    return blocks


def commands(block: str) -> list[list[str]]:
    """The simple commands of a shell block as their words: lines joined at a trailing backslash or an open quote,
    comments dropped, split at ``;``, ``&&``, ``||``, ``|`` and ``&``, leading ``NAME=value`` assignments left out."""
    found, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        try:
            tokens = [*lexer, ";"]
        except ValueError:  # a quotation that goes on on the next line
            continue
        pending, words = "", []
        for token in tokens:
            if token not in OPERATORS:
                words.append(token)
                continue
            while words and ASSIGNMENT.match(words[0]):
                words.pop(0)
            if words:
                found.append(words)
            words = []
    assert not pending, f"a quotation never closed: {pending!r}"
    return found


def program(words: list[str]) -> str:
    """The program a command runs, by name: ``.venv/bin/textsql`` is ``textsql``."""
    return Path(words[0]).name


def parse(command: click.Command, name: str, args: list[str], parent: click.Context | None = None) -> None:
    """Parse ``args`` as ``command`` would, down to its subcommand, calling nothing: an unknown or renamed option, a
    missing required one or a bad value raises click's error."""
    context = command.make_context(name, list(args), parent=parent)
    if isinstance(command, click.Group):
        rest = [*getattr(context, "_protected_args", []), *context.args]
        sub_name, subcommand, sub_args = command.resolve_command(context, rest)
        assert subcommand is not None and sub_name is not None, f"{name}: no command {rest[:1]}"
        parse(subcommand, sub_name, sub_args, context)
