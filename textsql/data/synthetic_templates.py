"""The English of synthetic questions: the phrasings that ask for a column, state a condition and join them.

WikiSQL itself started from template questions, later paraphrased by people; these templates stop at the
first step. :mod:`textsql.data.synthetic` picks among them with its seeded generator, so several phrasings
of each aggregation, operator and clause order appear in every split.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# The phrase that asks for the selected column, by aggregation; {col} is its name.
SELECT_PHRASES = {
    "": (
        "What is the {col}",
        "Which {col}",
        "Name the {col}",
        "Tell me the {col}",
        "What {col}",
        "Give the {col}",
        "List the {col}",
        "What was the {col}",
    ),
    "COUNT": (
        "How many {col}",
        "What is the number of {col}",
        "Count the {col}",
        "What is the count of {col}",
        "How many different {col}",
    ),
    "MAX": (
        "What is the highest {col}",
        "What is the largest {col}",
        "Name the maximum {col}",
        "What is the most {col}",
        "Tell me the greatest {col}",
    ),
    "MIN": (
        "What is the lowest {col}",
        "What is the smallest {col}",
        "Name the minimum {col}",
        "What is the least {col}",
        "Tell me the fewest {col}",
    ),
    "SUM": ("What is the sum of {col}", "What is the total {col}", "Add up the {col}", "What is the combined {col}"),
    "AVG": (
        "What is the average {col}",
        "What is the mean {col}",
        "Tell me the average {col}",
        "Name the average {col}",
    ),
}
# One condition, by operator; {col} is the column's name and {value} the value as it is written.
CONDITION_PHRASES = {
    "=": (
        "{col} is {value}",
        "the {col} is {value}",
        "{col} of {value}",
        "a {col} of {value}",
        "{value} as {col}",
        "{col} {value}",
        "{col} equal to {value}",
        "the {col} was {value}",
    ),
    ">": (
        "{col} greater than {value}",
        "{col} more than {value}",
        "a {col} above {value}",
        "{col} larger than {value}",
        "{col} over {value}",
        "the {col} is bigger than {value}",
    ),
    "<": (
        "{col} less than {value}",
        "{col} smaller than {value}",
        "a {col} below {value}",
        "{col} under {value}",
        "{col} fewer than {value}",
        "the {col} is lower than {value}",
    ),
}
# The word between the selected column and its conditions ("What is the Rank when Player is X?").
CLAUSE_JOINERS = ("when", "where", "for", "with", "if")
# The word that opens a question whose conditions come first ("For Player is X, what is the Rank?").
LEADING_CLAUSE_OPENERS = ("For", "With", "When")
# What joins two conditions.
CONDITION_JOINERS = (" and ", ", ", " and also ")
