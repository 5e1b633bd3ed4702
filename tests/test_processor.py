"""The grammar processor's arithmetic (textsql.decoding.processor): what it returns for a batch of rows, checked
against the plain formula; what it allows is tested in test_grammar.py."""

import math

import torch


def test_normalising_over_the_allowed_tokens_alone_equals_normalising_over_the_whole_row():
    """The processor's log-sum-exp runs over each constrained row's allowed tokens, not the 32,128 of the vocabulary:
    the same scores as the whole row's, for a row with several allowed tokens, one whose allowed tokens the phrase
    choice set to -inf, one with none, and an unconstrained row."""
    from textsql.decoding.processor import normalised

    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 50, generator=generator)
    masked = torch.full_like(scores, -math.inf)
    allowed = {0: [3, 17, 41], 1: [5, 6]}
    row_index = torch.tensor([row for row, tokens in allowed.items() for _ in tokens])
    token_index = torch.tensor([token for tokens in allowed.values() for token in tokens])
    masked[row_index, token_index] = scores[row_index, token_index]
    masked[1, [5, 6]] = -math.inf  # the phrase choice refused both
    masked[3] = scores[3]  # unconstrained; row 2 has nothing allowed
    total = masked.logsumexp(-1, keepdim=True)
    whole_row = masked - total.masked_fill(total.isneginf(), 0.0)

    result = normalised(masked.clone(), row_index, token_index, [3])

    assert torch.allclose(result, whole_row, atol=1e-6) and not result.isnan().any()
    assert result[1].isneginf().all() and result[2].isneginf().all()
    assert torch.allclose(result[[0, 3]].logsumexp(-1), torch.zeros(2), atol=1e-6)
