"""Text a worker controls, made safe to show a person: the ranks' output, ``cluster.json``'s table, the collective
figures, host and pod names, error text.

A worker can print terminal escape sequences (which move the cursor, rewrite the screen, set a window's title),
carriage returns, and the line breaks ``str.splitlines()`` honours besides ``\\n`` (``\\x1c``-``\\x1e``, ``\\x85``,
``\\u2028``, ``\\u2029``): any of them can make its text look like a line this side printed. Everything of that
kind passes through here on its way into a terminal or a notebook: lines are cut at ``\\n`` alone, and in each
line every control, format (bidirectional overrides included), private-use, unassigned or line-breaking
character but a tab is shown as its escape (``\\x1b``, ``\\r``, ``\\u2028``), never acted on.

Usage::

    >>> sanitized("127.0.0.3: done\\rpdsh@m: 127.0.0.2: ssh exited with exit code 255")
    '127.0.0.3: done\\\\rpdsh@m: 127.0.0.2: ssh exited with exit code 255'
    >>> sanitized_lines("a\\u2028b\\nc")
    ['a\\\\u2028b', 'c']
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

# A URL's authority after its scheme: up to the path, or the end of the word. One pass over the text, whatever
# it holds (a regex that tried every scheme-like start was quadratic: 26 s for one 60k-character rank line).
_AUTHORITY = re.compile(r"://([^/\s]*)")
# What replaces a password.
MASK = "***"
# Printable ASCII and the tab are always shown as they are; anything else is looked up by its category.
NOT_PLAIN_ASCII = re.compile(r"[^\t\x20-\x7e]")
# Control, format, surrogate, private use, unassigned; line and paragraph separators.
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Characters escaped at a time. Each escaped character costs a match object and an escape string until its piece
# is joined (about 64 bytes); joined a piece at a time, a line of control bytes costs its escaped text twice, not 79
# times its own length (a rank's 4 MiB line of NULs took 317 MiB at once).
_PIECE_CHARACTERS = 4096


def sanitized(text: object) -> str:
    """One line of worker text (or any value, as ``str()`` writes it) with its unsafe characters as escapes.

    :param text: the value; a ``\\n`` in it is escaped too (use :func:`sanitized_lines` to keep its lines).
    :rtype: str
    """
    text = str(text)
    if len(text) <= _PIECE_CHARACTERS:
        return NOT_PLAIN_ASCII.sub(_visible, text)
    pieces = range(0, len(text), _PIECE_CHARACTERS)
    return "".join([NOT_PLAIN_ASCII.sub(_visible, text[start : start + _PIECE_CHARACTERS]) for start in pieces])


def sanitized_lines(text: str) -> list[str]:
    """Worker text cut into lines at ``\\n`` alone, each made safe by :func:`sanitized`.

    :param text: the text.
    :rtype: list[str]
    """
    return [sanitized(line) for line in text.split("\n")]


def sanitized_record(value: Any) -> Any:
    """A JSON value a worker wrote with every string in it, keys included, made safe by :func:`sanitized`; numbers,
    booleans and None as they are, so a view formats them as before.

    :param value: what ``json.load`` gave.
    :rtype: Any
    """
    if isinstance(value, str):
        return sanitized(value)
    if isinstance(value, dict):
        return {sanitized(key): sanitized_record(item) for key, item in value.items()}
    if isinstance(value, list):
        return [sanitized_record(item) for item in value]
    return value


def _visible(found: re.Match[str]) -> str:
    character = found.group()
    if unicodedata.category(character) in ESCAPED_CATEGORIES:
        return character.encode("unicode_escape").decode("ascii")
    return character


def mask_credentials(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``, for logs, terminals and warnings.

    The user part ends at the authority's last ``@``, so a password holding ``@`` is masked whole; linear in the
    text's length (every rank line passes here).

    Usage::

        >>> mask_credentials("proxy http://alice:p@ss@proxy:3128 used")
        'proxy http://alice:***@proxy:3128 used'

    :rtype: str
    """
    return _AUTHORITY.sub(_masked_authority, text)


def has_url_password(text: str) -> bool:
    """Whether ``text`` holds a URL with a password in its user part (a proxy, a package index, a tracking URI).

    :rtype: bool
    """
    return mask_credentials(text) != text


def _masked_authority(match: re.Match[str]) -> str:
    userinfo, at, host = match.group(1).rpartition("@")
    user, colon, _password = userinfo.partition(":")
    return f"://{user}:{MASK}@{host}" if at and colon else match.group(0)
