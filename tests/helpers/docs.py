"""The code blocks of the Markdown pages, what each needs, and the command lines of their shell blocks.

Blocks are found by sybil's Markdown fence lexer. A fence's language says what the tests do with it
(CONTRIBUTING.md, "Documentation"): :data:`RUN` blocks are run, :data:`SHOWN` ones are output, files or drawings.
Marks just above a fence, invisible on the site, say more:

- ``<!-- needs: hub -->``: it needs something a test machine lacks (:data:`NEEDS`); skipped, by that name, and its
  commands still parsed;
- ``<!-- serves: http://127.0.0.1:8000 -->``: it starts a server, which must answer there;
- ``<!-- after: make demo -->``: it reads what the block ``make demo`` (on any page) writes, which runs first.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
from sybil import Document, Region
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

from helpers.paths import PROJECT_DIR

NEEDS = {
    "hub": "the Hugging Face hub (a network)",
    "gpu": "a CUDA GPU",
    "cluster": "hosts, a cluster or a tracking server to launch on, or a deployed model",
    "docker": "Docker, to build the image",
    "pypi": "the package index (a network) and a Python environment of your own to install into",
    "suite": "the time of the whole test suite, which is what runs this block",
}
# A fence's language is a decision: run it, or show it. A reader's shell is bash; Python is a notebook's cell.
RUN = {"bash", "python"}
SHOWN = {"text", "console", "json", "yaml", "sql", "toml", "ini", "mermaid"}
# What a page may run from the system rather than from the project's .venv/bin (tests/test_docs.py).
SYSTEM_PROGRAMS = {"make", "grep", "bash", "curl", "docker", "pip", "python", "kubectl", "mkdir", "cat", "cp"}
SHELL_WORDS = {"export", "for", "do", "done", "break", "cd"}
MARKS = re.compile(r"(?:<!-- [a-z]+(?:: [^>]*?)? -->\n\n?)+$")
MARK = re.compile(r"<!-- (?P<key>[a-z]+)(?:: (?P<value>[^>]*?))? -->")
LEXER = RawFencedCodeBlockLexer(
    info_pattern=re.compile(r"(?P<language>[^\s`]*)[^\n]*$\n", re.MULTILINE),
    mapping={"language": "language", "source": "source"},
)
OPERATORS = {";", "&&", "||", "|", "&"}
HERE_DOCUMENT = re.compile(r"<<-?\s*'?(?P<end>\w+)'?")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, its language and text, and its marks."""

    page: Path
    line: int
    language: str
    text: str
    needs: str | None = None
    serves: str | None = None
    after: str | None = None

    def __str__(self) -> str:
        page = self.page.relative_to(PROJECT_DIR) if self.page.is_relative_to(PROJECT_DIR) else self.page
        return f"{page}:{self.line}"


def marks(text: str, end: int) -> dict[str, str]:
    """The ``<!-- key: value -->`` marks that stand right above position ``end`` of ``text``."""
    above = MARKS.search(text, 0, end)
    return {mark["key"]: mark["value"] or "" for mark in MARK.finditer(above.group(0))} if above else {}


def block_regions(document: Document) -> list[Region]:
    """A sybil parser: a region per fenced block of ``document``, its parsed value the :class:`Block`."""
    regions = []
    for region in LEXER(document):
        found = marks(document.text, region.start)
        block = Block(
            Path(document.path),
            document.text.count("\n", 0, region.start) + 1,
            region.lexemes["language"],
            str(region.lexemes["source"]),
            found.get("needs"),
            found.get("serves"),
            found.get("after"),
        )
        regions.append(Region(region.start, region.end, block))
    return regions


def blocks(pages: list[Path]) -> list[Block]:
    """Every fenced block of ``pages``, in order."""
    return [region.parsed for page in pages for region in block_regions(Document(page.read_text(), str(page)))]


def shell_blocks(pages: list[Path]) -> list[Block]:
    """Every ``bash`` block of ``pages``, in order."""
    return [block for block in blocks(pages) if block.language == "bash"]


def commands(block: str) -> list[list[str]]:
    """The simple commands of a shell block as their words: lines joined at a trailing backslash or an open quote,
    comments dropped, split at ``;``, ``&&``, ``||``, ``|`` and ``&``, leading ``NAME=value`` assignments left out;
    a here-document's lines are text, not commands."""
    found, pending, here_end = [], "", None
    for line in block.replace("\\\n", " ").splitlines():
        if here_end is not None:
            here_end = None if line.strip() == here_end else here_end
            continue
        here = HERE_DOCUMENT.search(line)
        if here:
            here_end, line = here["end"], line[: here.start()]
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
