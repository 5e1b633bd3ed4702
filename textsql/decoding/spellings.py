"""The spellings of a question's words that a WikiSQL condition value may take (:mod:`textsql.decoding.grammar`).

A value is a span of the question's words: its first and last word may drop the punctuation a question
glues on (``3?``, ``Rice's``, ``"Big``), and each word may be written as it is, lower-, upper- or
first-letter-upper case, since WikiSQL values follow the table's cells while questions are often lower case.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

# What a question glues to the ends of a value: "number 3?", "loc.?", "Rice's", "(KS)".
_TRAILING_MARKS = "?!.,;:\"'"
_POSSESSIVE = "'s"
_LEADING_MARKS = "\"'("


@functools.lru_cache(maxsize=1 << 16)
def _cases(word: str) -> list[str]:
    letter = next((index for index, char in enumerate(word) if char.isalpha()), 0)
    capitalized = word[:letter] + word[letter : letter + 1].upper() + word[letter + 1 :]
    return list(dict.fromkeys((word, word.lower(), word.upper(), capitalized, word.title())))


def _first_forms(word: str) -> list[str]:
    return [word] + ([word[1:]] if len(word) > 1 and word[0] in _LEADING_MARKS else [])


def _last_forms(word: str) -> list[str]:
    forms = [word]
    # Up to two marks: 'loc.?', '12"?'.
    for _ in range(2):
        if len(forms[-1]) > 1 and forms[-1][-1] in _TRAILING_MARKS:
            forms.append(forms[-1][:-1])
    forms += [
        form[: -len(_POSSESSIVE)] for form in list(forms) if form.endswith(_POSSESSIVE) and len(form) > len(_POSSESSIVE)
    ]
    return forms


class Spellings(NamedTuple):
    """How one question word may be written in a condition value, by where it stands in the value."""

    inner: frozenset[str]  # neither first nor last: the word as it is, in any case
    first: frozenset[str]  # the value's first word: a leading mark may go
    last: frozenset[str]  # the value's last word: trailing marks and a possessive may go
    only: frozenset[str]  # the value's only word: both


@functools.lru_cache(maxsize=1 << 16)
def value_spellings(word: str) -> Spellings:
    """A question word's spellings as a condition value's inner, first, last and only word.

    Usage::

        >>> sorted(value_spellings("Rice's").last)
        ['RICE', "RICE'S", 'Rice', "Rice'S", "Rice's", 'rice', "rice's"]

    :param word: one whitespace-separated word of a question.
    :rtype: Spellings
    """
    firsts, lasts = _first_forms(word), _last_forms(word)
    onlies = [form for first in firsts for form in _last_forms(first)]
    return Spellings(
        *(frozenset(case for form in forms for case in _cases(form)) for forms in ([word], firsts, lasts, onlies))
    )
