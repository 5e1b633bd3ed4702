"""Questions and tokens per second of the batches that ran, for ``run.json``.

The trainer's own ``train_samples_per_second`` is ``per_device_train_batch_size`` x world size x steps over the
run's time; a token-budget batch (:mod:`textsql.training.batching`) holds as many questions as fit its budget, a
few or hundreds, so that figure says nothing of it. :class:`BatchCounts` counts what each training batch held:
questions and padded positions from the tensors' shapes (known on the host, no sync), and the tokens that are not
padding summed on the batch's device, read once when the run ends.

Usage::

    >>> counts = BatchCounts()
    >>> counts.add({"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5),
    ...             "labels": torch.tensor([[4, 1, -100], [5, 6, 1]])})
    >>> counts.record(seconds=2.0)["tokens_per_second"]
    7.5
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from textsql.constants import LABEL_PAD_TOKEN_ID


class BatchCounts:
    """What the training batches of this rank held, summed over the run."""

    def __init__(self) -> None:
        self.questions = 0
        self.padded_tokens = 0
        self.tokens: torch.Tensor | None = None  # on the batches' device, added to without reading it

    def add(self, batch: Mapping[str, Any]) -> None:
        """Count one training batch (``input_ids``, ``attention_mask``, ``labels``)."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        self.questions += input_ids.shape[0]
        self.padded_tokens += input_ids.numel() + labels.numel()
        tokens = batch["attention_mask"].sum() + (labels != LABEL_PAD_TOKEN_ID).sum()
        self.tokens = tokens if self.tokens is None else self.tokens + tokens

    def totals(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Questions, tokens and padded tokens of this rank, as one int64 tensor on ``device``.

        :rtype: torch.Tensor
        """
        tokens = self.tokens.to(device) if self.tokens is not None else torch.zeros((), device=device)
        counts = torch.tensor([self.questions, self.padded_tokens], device=device)
        return torch.stack([counts[0], tokens.long(), counts[1]])

    def record(self, seconds: float, device: torch.device | str = "cpu") -> dict[str, Any]:
        """Counts and rates over ``seconds`` of training, summed over every rank where a process group is up (a
        collective, on ``device``: every rank calls it).

        :rtype: dict[str, typing.Any]
        """
        totals = self.totals(device)
        world = torch.distributed.is_available() and torch.distributed.is_initialized()
        if world:
            torch.distributed.all_reduce(totals)
        questions, tokens, padded = (int(value) for value in totals.tolist())
        return {
            "questions": questions,
            "tokens": tokens,
            "padded_tokens": padded,
            "seconds": round(seconds, 3),
            "samples_per_second": round(questions / seconds, 3) if seconds else None,
            "tokens_per_second": round(tokens / seconds, 3) if seconds else None,
            "padded_tokens_per_second": round(padded / seconds, 3) if seconds else None,
        }
