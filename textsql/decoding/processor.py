"""The WikiSQL grammar of :mod:`textsql.decoding.grammar` applied during ``generate``: a ``LogitsProcessor`` per batch.

Each row's state advances by its last token; every token the grammar refuses is masked, and where a
state offers aggregation keywords beside columns the choice is made between phrases, not first
tokens (:func:`choose_phrases`). What is left is renormalised: the scores are log-probabilities over the tokens
the grammar allows, which is what beam search should add up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import cast

import torch
from transformers import LogitsProcessor, PreTrainedTokenizerBase

from textsql.data.wikisql import read_source_text
from textsql.decoding.grammar import QueryAutomaton, compile_automata

logger = logging.getLogger(__name__)


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks every token that would take a row's output out of its question's WikiSQL grammar.

    Rows are ``len(automata) * k`` (``k`` beams per question, in question order), as ``generate``
    lays them out; a question whose automaton is ``None`` is left unconstrained.

    :param automata: one per question of the batch.
    :param max_new_tokens: the tokens ``generate`` may write after the decoder's start token.
    """

    def __init__(self, automata: Sequence[QueryAutomaton | None], max_new_tokens: int):
        self.automata = list(automata)
        self.max_new_tokens = max_new_tokens
        self._states: dict[tuple[int, tuple[int, ...]], int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not any(self.automata):
            return scores
        sequences = input_ids[:, 1:].tolist()
        per_question = len(sequences) // len(self.automata)
        remaining = self.max_new_tokens - input_ids.shape[1] + 1
        states, rows, counts, allowed, free, choices = {}, [], [], [], [], []
        for row, sequence in enumerate(sequences):
            question = row // per_question
            automaton = self.automata[question]
            if automaton is None:
                free.append(row)
                continue
            key = (question, tuple(sequence))
            if key not in states:
                states[key] = self._state(automaton, key)
            tokens = automaton.allowed(states[key], remaining)
            rows.append(row)
            counts.append(len(tokens))
            allowed.append(tokens)
            choice = automaton.choice(states[key])
            if choice is not None:
                choices.append((row, choice))
        # Only the states one step back are ever looked up again.
        self._states = states
        # Only the few allowed scores are copied into a row of -inf: the vocabulary-wide passes (32,128 tokens a
        # row, every beam, every step) are what this costs, so there are as few of them as the result allows.
        masked = torch.full_like(scores, -math.inf)
        row_index = torch.repeat_interleave(
            torch.tensor(rows, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
        )
        row_index = row_index.to(scores.device)
        token_index = torch.cat(allowed).to(scores.device) if allowed else row_index
        masked[row_index, token_index] = scores[row_index, token_index]
        if free:
            masked[free] = scores[free]
        if choices:
            masked = choose_phrases(scores, masked, choices)
        return cast(torch.FloatTensor, normalised(masked, row_index, token_index, free))

    def _state(self, automaton: QueryAutomaton, key: tuple[int, tuple[int, ...]]) -> int:
        question, sequence = key
        if not sequence:
            return automaton.start
        parent = self._states.get((question, sequence[:-1]))
        if parent is None:
            parent = self._state(automaton, (question, sequence[:-1]))
        return automaton.advance(parent, sequence[-1])


def normalised(
    masked: torch.Tensor, row_index: torch.Tensor, token_index: torch.Tensor, free: list[int]
) -> torch.Tensor:
    """Each row of ``masked`` minus its log-sum-exp, in place: log-probabilities over the tokens the grammar allows.

    Beam search adds these up: as the model's log-probabilities with the refused tokens cut out, a beam through a
    column the model would not have named (a header it never saw) pays for the names it may not write, and beams
    drift to columns whose names it half knows. Normalised, they rank queries by their probability among what the
    grammar allows (greedy decoding picks the same token either way). A row with nothing left stays -inf (its
    log-sum-exp, -inf, is not subtracted: that would make it NaN).

    A constrained row's sum runs over its allowed tokens alone (``row_index``, ``token_index``: each row's once),
    every other entry being -inf: over the whole vocabulary (32,128 tokens a row, every beam, every step) it was a
    quarter of ``generate``'s time in the demo's inference. Unconstrained rows (``free``) sum over their whole row.

    :rtype: torch.Tensor
    """
    total = torch.full(masked.shape[:1], -math.inf, dtype=masked.dtype, device=masked.device)
    kept = masked[row_index, token_index]
    peak = total.scatter_reduce(0, row_index, kept, "amax")
    peak = peak.masked_fill(peak.isneginf(), 0.0)
    sums = torch.zeros_like(total).index_add_(0, row_index, (kept - peak[row_index]).exp())
    total = peak + sums.log()
    if free:
        total[free] = masked[free].logsumexp(-1)
    shift = total.masked_fill(total.isneginf(), 0.0)
    masked[row_index, token_index] = kept - shift[row_index]
    if free:
        masked[free] -= shift[free, None]
    return masked


def choose_phrases(
    scores: torch.Tensor, masked: torch.Tensor, choices: Sequence[tuple[int, tuple[torch.Tensor, torch.Tensor]]]
) -> torch.Tensor:
    """Decide, per row, between a state's competing phrases and its other phrases as wholes.

    A row keeps its competing tokens (aggregations' first tokens) only if the best of them scores
    above the logsumexp of every other token of the vocabulary, the model's probability that the
    phrase is not one of them ("no aggregation"); otherwise it keeps the others. The sum runs over
    the whole vocabulary, not only this table's columns: a model still learning spreads a column's
    probability over names it has seen in other tables (on the 200-step demo model, summing only
    this table's columns still chose an aggregation for 92 of 100 validation questions).

    :param scores: the scores before the grammar's mask, one row per beam.
    :param masked: the same with every token the grammar refuses at ``-inf``; changed in place.
    :param choices: the rows that face such a choice, each with its :meth:`QueryAutomaton.choice`.
    :rtype: torch.Tensor
    """
    rows = torch.tensor([row for row, _ in choices], device=scores.device)
    sides = []
    for side in range(2):
        tokens = [choice[side] for _, choice in choices]
        member = torch.zeros_like(masked[rows], dtype=torch.bool)
        spans = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor([len(part) for part in tokens]))
        member[spans.to(scores.device), torch.cat(tokens).to(scores.device)] = True
        sides.append(member)
    competing, others = sides
    picked = masked[rows]
    wins = picked.masked_fill(~competing, -math.inf).amax(-1) > scores[rows].masked_fill(
        competing, -math.inf
    ).logsumexp(-1)
    masked[rows] = picked.masked_fill(torch.where(wins[:, None], others, competing), -math.inf)
    return masked


def grammar_processor(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    headers: Sequence[list[str] | None],
    max_new_tokens: int,
    uncased: bool = False,
) -> GrammarLogitsProcessor:
    """A processor for one batch of questions, each over its own header.

    Usage::

        >>> processor = grammar_processor(tokenizer, ["Who is number 3?"], [["Player", "No."]], 64)  # doctest: +SKIP
        >>> model.generate(**batch, logits_processor=LogitsProcessorList([processor]), max_new_tokens=64)  # doctest: +SKIP

    :param uncased: the model writes its queries in lower case (the ``uncased`` input format).
    :rtype: GrammarLogitsProcessor
    """
    return GrammarLogitsProcessor(compile_automata(tokenizer, questions, headers, uncased), max_new_tokens)


def processor_for_inputs(
    tokenizer: PreTrainedTokenizerBase, input_ids: torch.Tensor, max_new_tokens: int, uncased: bool = False
) -> GrammarLogitsProcessor:
    """A processor for a batch of tokenized model inputs, reading each question and header back from
    its input text (:func:`textsql.data.wikisql.read_source_text`): what the trainer's evaluation has.

    :rtype: GrammarLogitsProcessor
    """
    sources = [read_source_text(text) for text in tokenizer.batch_decode(input_ids, skip_special_tokens=True)]
    if not any(header for _, header in sources):
        logger.debug("the inputs carry no table header (question-only input format): generation is not constrained")
    return grammar_processor(
        tokenizer, [question for question, _ in sources], [header for _, header in sources], max_new_tokens, uncased
    )
