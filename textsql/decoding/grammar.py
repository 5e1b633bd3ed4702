"""Decoding constrained to the WikiSQL grammar of each question's own table.

A model may write only ``SELECT [AGG] column FROM table [WHERE column op value (AND column op value)*]``
as :func:`textsql.data.sql.render_sql` renders it: a column is one of the table's header names, an operator
one of :data:`textsql.constants.COND_OP_TEXT` (``LT`` for ``<``), and a value a span of the question's
words (the span's first and last word may drop the punctuation a question glues on, as in ``3?`` or
``Rice's``, and each word may be written as it is, lower-, upper- or first-letter-upper case, since
WikiSQL values follow the table's cells while questions are often lower case). As in WikiSQL, a query
has at most :data:`textsql.constants.MAX_CONDITIONS` conditions and names each column at most once
(no condition on the selected column, none on a column twice: none of dev's and test's 24,299 queries
has either). EOS is allowed exactly where a query may end.

How: T5's tokenizer splits text at whitespace and encodes every word on its own (``▁`` + pieces,
with the same pieces at the start of a text as in its middle), so a query's tokens are its words'
tokens one after another. Each question gets a :class:`QueryAutomaton`: states joined by phrases
(keyword, column name, operator, question word) as token sequences; the phrases leaving one state
share a token trie, and the set of trie nodes a prefix of tokens can be in, each with the columns the
query has named so far, is a state of a deterministic automaton built lazily as decoding visits it. :class:`textsql.decoding.processor.GrammarLogitsProcessor`
advances each row's state by its last token at every step and masks every other token, and every token after
which no whole query fits in the tokens left, so an output cut at ``max_new_tokens`` still ends in EOS.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from textsql.constants import AGG_OPS, COND_OP_TEXT, MAX_CONDITIONS, SQL_TABLE_NAME
from textsql.decoding.spellings import Spellings, value_spellings

logger = logging.getLogger(__name__)

# The label of the phrases that begin a condition (WHERE, AND); a column phrase's label is its name.
CONDITION = ""
# A trie node and the columns named before it.
Member = tuple[int, frozenset[str]]


@dataclass
class Node:
    """A node of a phrase trie; a trie's root is a state of the phrase-level grammar."""

    # Each token's child node, and the phrases ending here: (the state entered, the phrase's label).
    children: dict[int, int] = field(default_factory=dict)
    exits: list[tuple[int, str | None]] = field(default_factory=list)
    # The fewest tokens from here to EOS included, whatever the columns named so far (what a phrase
    # entering the node's root adds to its own length); the same through unlabelled phrases only, and
    # through each label's phrases.
    distance: float = math.inf
    free: float = math.inf
    labelled: dict[str, float] = field(default_factory=dict)


@dataclass
class State:
    """A state of the deterministic automaton: its members, and what every mask in it needs."""

    members: frozenset[Member]
    # The state after each token, filled as decoding takes the moves.
    moves: dict[int, int]
    # The allowed tokens, cheapest first, with each one's cost (the fewest tokens from there to EOS).
    tokens: torch.Tensor
    costs: torch.Tensor
    highest_cost: float
    # The tokens of each side of a choice between competing phrases and the rest (None: no such choice).
    choice: tuple[torch.Tensor, torch.Tensor] | None


class QueryAutomaton:
    """The token-level grammar of the queries over one table for one question.

    Nodes are trie nodes; an automaton state (see :meth:`start`, :meth:`advance`) is a set of
    members, each a node with the columns named on the way to it, closed under the phrase ends that
    enter another trie's root. Labelled phrases (:meth:`add`) are what those columns decide: a
    column's phrase only if the column is not named yet, a condition's start (:data:`CONDITION`)
    only while fewer than ``max_conditions`` conditions are written and an unnamed column is left.

    Usage::

        >>> automaton = QueryAutomaton.build(tokenizer, "How many schools?", ["No.", "School"])  # doctest: +SKIP
        >>> state = automaton.advance(automaton.start, 3)                      # doctest: +SKIP
        >>> tokenizer.convert_ids_to_tokens(automaton.allowed(state, remaining=64))  # doctest: +SKIP
        ['SEL']
    """

    def __init__(self, eos_token_id: int, pad_token_id: int, max_conditions: int = MAX_CONDITIONS):
        self.nodes: list[Node] = []
        self.max_conditions = max_conditions
        self.condition = -1
        self.eos_token_id = eos_token_id
        # After EOS a greedy search keeps feeding pad tokens to finished rows; they stay done.
        self.done = self.root()
        self.nodes[self.done].distance = self.nodes[self.done].free = 0
        for token in dict.fromkeys((eos_token_id, pad_token_id)):
            self.nodes[self.done].children[token] = self.done
        self._numbers: dict[frozenset[Member], int] = {}
        self._states: list[State] = []
        # Nodes inside phrases that each compete, as one alternative, with a state's other phrases
        # together (see :meth:`compete`).
        self.competing: set[int] = set()
        self.start = -1

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, question: str, header: Sequence[str]) -> QueryAutomaton | None:
        """The automaton for one question over one header (``None`` when no column can be written).

        :param tokenizer: the model's tokenizer.
        :param question: the question whose words condition values may copy.
        :param header: the table's column names.
        :rtype: QueryAutomaton | None
        """
        return compile_automata(tokenizer, [question], [list(header)])[0]

    def root(self) -> int:
        """A new state of the phrase-level grammar: the root of its own trie."""
        self.nodes.append(Node())
        return len(self.nodes) - 1

    def add(self, source: int, tokens: Sequence[int], target: int, label: str | None = None) -> None:
        """A phrase (token sequence) leading from state ``source`` to state ``target``.

        Distances to EOS are kept as phrases are added, which is exact when phrases are added from
        the end of a query backwards (a target's own phrases before the phrases entering it).

        :param label: a column's name for its phrase, :data:`CONDITION` for a phrase that enters
            the conditions' state (:meth:`finish`), ``None`` for any other.
        """
        node, left = source, len(tokens) + self.nodes[target].distance
        self._reach(self.nodes[node], left, label)
        for token in tokens:
            if token not in self.nodes[node].children:
                self.nodes[node].children[token] = self.root()
            node, left = self.nodes[node].children[token], left - 1
            self._reach(self.nodes[node], left, label)
        self.nodes[node].exits.append((target, label))

    @staticmethod
    def _reach(node: Node, left: float, label: str | None) -> None:
        node.distance = min(node.distance, left)
        if label is None:
            node.free = min(node.free, left)
        else:
            node.labelled[label] = min(node.labelled.get(label, math.inf), left)

    def compete(self, source: int, tokens: Sequence[int], target: int) -> None:
        """Make an added phrase from ``source`` to ``target`` one alternative facing all the state's
        phrases to other targets together; a prefix it shares with those stays out of the contest.

        Token by token, one of many columns' first tokens can lose to ``COUNT``'s although the columns
        together, "no aggregation", are likelier: :meth:`choice` lets a processor compare the phrase's
        score with the other phrases' summed probability instead.
        """
        node = source
        for token in tokens:
            node = self.nodes[node].children[token]
            pending, only = [node], True
            while pending and only:
                below = self.nodes[pending.pop()]
                only = all(end == target for end, _ in below.exits)
                pending.extend(below.children.values())
            if only:
                self.competing.add(node)

    def choice(self, state: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tokens that lead only into competing phrases (:meth:`compete`) and those that lead only
        elsewhere, where ``state`` has both (``None`` otherwise); a token leading to both is in neither.

        :rtype: tuple[torch.Tensor, torch.Tensor] | None
        """
        return self._states[state].choice

    def finish(self, first: int, condition: int) -> None:
        """Fix the grammar once every phrase is added.

        :param first: the state a query starts in.
        :param condition: the state a condition starts in, whose phrases are the columns.
        """
        self.condition = condition
        self.start = self._state(frozenset([(first, frozenset())]))

    def advance(self, state: int, token: int) -> int:
        """The state after ``token``; a token the grammar does not allow (a pruned beam) ends the query.

        :rtype: int
        """
        moves = self._states[state].moves
        if token not in moves:
            children = [(self.nodes[node].children, used) for node, used in self._states[state].members]
            targets = frozenset(
                (after[token], used)
                for after, used in children
                if token in after and self._cost(after[token], used) < math.inf
            )
            moves[token] = self._state(targets or frozenset([(self.done, frozenset())]))
        return moves[token]

    def allowed(self, state: int, remaining: int) -> torch.Tensor:
        """The tokens allowed in ``state`` after which a whole query still fits in ``remaining`` tokens.

        When none fits (a ``max_new_tokens`` too small for any query) every grammatical token is allowed.

        :rtype: torch.Tensor
        """
        tokens = self._states[state].tokens
        if self._states[state].highest_cost < remaining:
            return tokens
        fitting = tokens[self._states[state].costs < remaining]
        return fitting if fitting.numel() else tokens

    def _cost(self, node: int, used: frozenset[str]) -> float:
        """The fewest tokens from ``node`` to EOS included, with the columns in ``used`` named already."""
        here = self.nodes[node]
        cost = here.free
        for label, left in here.labelled.items():
            if label == CONDITION:
                if self._may_add_condition(used):
                    # The labelled distance took the shortest column; the shortest unnamed one is what counts.
                    cost = min(cost, left - self.nodes[self.condition].distance + self._cost(self.condition, used))
            elif label not in used:
                cost = min(cost, left)
        return cost

    def _may_add_condition(self, used: frozenset[str]) -> bool:
        # ``used`` holds the selected column and one per condition written.
        return len(used) <= self.max_conditions and self._cost(self.condition, used) < math.inf

    def _closure(self, members: frozenset[Member]) -> frozenset[Member]:
        closed = set(members)
        pending = list(members)
        while pending:
            node, used = pending.pop()
            for target, label in self.nodes[node].exits:
                if label is None or label == CONDITION and self._may_add_condition(used):
                    member = (target, used)
                elif label != CONDITION and label not in used:
                    member = (target, used | {label})
                else:
                    continue
                if member not in closed:
                    closed.add(member)
                    pending.append(member)
        return frozenset(closed)

    def _state(self, members: frozenset[Member]) -> int:
        key = self._closure(members)
        if key in self._numbers:
            return self._numbers[key]
        # Moves are filled as decoding takes them; the cost of each token (the fewest tokens from
        # there to EOS) is needed for every mask, so it is computed now.
        cost: dict[int, float] = {}
        sides: dict[int, set[bool]] = {}
        nodes = self.nodes  # this loop is the grammar's hot path: one lookup, not one per token
        for node, used in key:
            for token, child in nodes[node].children.items():
                sides.setdefault(token, set()).add(child in self.competing)
                reach = self._cost(child, used) if nodes[child].labelled else nodes[child].free
                if reach < cost.get(token, math.inf):
                    cost[token] = reach
        ordered = sorted(cost, key=cost.__getitem__)
        competing = [token for token, side in sides.items() if side == {True}]
        others = [token for token, side in sides.items() if side == {False}]
        number = self._numbers[key] = len(self._states)
        self._states.append(
            State(
                members=key,
                moves={},
                tokens=torch.tensor(ordered, dtype=torch.long),
                costs=torch.tensor([cost[token] for token in ordered], dtype=torch.float),
                highest_cost=max(cost.values(), default=0),
                choice=(torch.tensor(competing), torch.tensor(others)) if competing and others else None,
            )
        )
        return number


class _Phrases:
    """Token sequences of the phrases of one batch, tokenized in one call, keeping only those that decode back."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, texts: set[str], uncased: bool = False):
        ordered = sorted(texts)
        written = [text.lower() for text in ordered] if uncased else ordered
        encoded = tokenizer(written, add_special_tokens=False)["input_ids"] if ordered else []
        decoded = tokenizer.batch_decode(encoded, skip_special_tokens=True) if ordered else []
        # A phrase with a character the vocabulary lacks decodes to other text, which the parser
        # would not find in the header; such a phrase is left out of the grammar.
        self.tokens = {
            text: tuple(ids)
            for text, form, ids, back in zip(ordered, written, encoded, decoded)
            if ids and tokenizer.unk_token_id not in ids and back.strip() == " ".join(form.split())
        }

    def add(
        self,
        automaton: QueryAutomaton,
        source: int,
        texts: Iterable[str],
        target: int,
        label: str | None = None,
    ) -> None:
        # Spellings that differ only in case are one phrase in lower case.
        for tokens in dict.fromkeys(self.tokens[text] for text in texts if text in self.tokens):
            automaton.add(source, tokens, target, label)


def compile_automata(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    headers: Sequence[list[str] | None],
    uncased: bool = False,
) -> list[QueryAutomaton | None]:
    """One :class:`QueryAutomaton` per question (``None`` without a header or with no writable column).

    :param tokenizer: the model's tokenizer.
    :param questions: the questions, in batch order.
    :param headers: each question's column names (``None`` when unknown: that question is unconstrained).
    :param uncased: the query is written in lower case (keywords, columns and values), as the ``uncased``
        input format trains a model to write it.
    :rtype: list[QueryAutomaton | None]
    """
    keywords = ["SELECT", f"FROM {SQL_TABLE_NAME}", "WHERE", "AND", *filter(None, AGG_OPS), *COND_OP_TEXT]
    words = [question.split() for question in questions]
    values = [[value_spellings(word) for word in question_words] for question_words in words]
    texts = set(keywords) | {name for header in headers for name in header or []}
    texts |= {form for question in values for spellings in question for forms in spellings for form in forms}
    phrases = _Phrases(tokenizer, texts, uncased)
    automata: list[QueryAutomaton | None] = []
    for header, question_values in zip(headers, values):
        columns = [name for name in header or [] if name in phrases.tokens]
        if not columns:
            if header:
                logger.warning("no column of %r can be written with this tokenizer; decoding it unconstrained", header)
            automata.append(None)
            continue
        automata.append(_automaton(tokenizer, phrases, columns, question_values))
    return automata


def _automaton(
    tokenizer: PreTrainedTokenizerBase, phrases: _Phrases, columns: list[str], values: list[Spellings]
) -> QueryAutomaton:
    """The grammar's states and phrases, added from a query's end backwards (see :meth:`QueryAutomaton.add`)."""
    automaton = QueryAutomaton(tokenizer.eos_token_id, tokenizer.pad_token_id)
    begin, select, aggregated, selected, complete, condition, operator, value = (automaton.root() for _ in range(8))
    # ended: a value that may end here; after[i]: a value whose last word is word i, as written.
    ended = automaton.root()
    after = [automaton.root() for _ in values]
    for end in (complete, ended, *after):
        automaton.add(end, (automaton.eos_token_id,), automaton.done)
    for position in reversed(range(len(values) - 1)):
        following = values[position + 1]
        phrases.add(automaton, after[position], following.inner, after[position + 1])
        phrases.add(automaton, after[position], following.last - following.inner, ended)
    for position, spellings in enumerate(values):
        phrases.add(automaton, value, spellings.first, after[position])
        phrases.add(automaton, value, spellings.only - spellings.first, ended)
    phrases.add(automaton, operator, COND_OP_TEXT, value)
    _add_columns(automaton, phrases, columns, condition, operator)
    for end in (ended, *after):
        phrases.add(automaton, end, ["AND"], condition, label=CONDITION)
    phrases.add(automaton, complete, ["WHERE"], condition, label=CONDITION)
    phrases.add(automaton, selected, [f"FROM {SQL_TABLE_NAME}"], complete)
    _add_columns(automaton, phrases, columns, aggregated, selected)
    _add_columns(automaton, phrases, columns, select, selected)
    phrases.add(automaton, select, list(filter(None, AGG_OPS)), aggregated)
    for keyword in filter(phrases.tokens.__contains__, AGG_OPS):
        automaton.compete(select, phrases.tokens[keyword], aggregated)
    phrases.add(automaton, begin, ["SELECT"], select)
    automaton.finish(begin, condition)
    return automaton


def _add_columns(automaton: QueryAutomaton, phrases: _Phrases, columns: list[str], source: int, target: int) -> None:
    """Every column's name from ``source`` to ``target``, labelled with the name (named once per query)."""
    for column in columns:
        automaton.add(source, phrases.tokens[column], target, label=column)
