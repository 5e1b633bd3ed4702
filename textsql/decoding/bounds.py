"""One generation length for evaluation and for the saved model: what the gold queries need.

A model that has not yet learnt to write ``</s>`` generates to the length bound on every question, so
the bound is the evaluation's cost: the longest tokenized gold query of the evaluation set plus a small
margin, not a fixed 64 or 128. It is set once, as ``max_new_tokens`` in the model's generation config
(saved with ``model/``, so inference generates alike), and ``max_length`` is cleared in that config and
in the trainer's arguments: with both set, transformers warns on every ``generate`` call and
``max_new_tokens`` silently wins. :class:`KeepGenerationBound` keeps it cleared during training.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
from transformers import PreTrainedModel, Seq2SeqTrainingArguments, TrainerCallback

logger = logging.getLogger(__name__)

GENERATION_MARGIN = 8  # room past the longest gold query, for a near miss to still end with </s>


def longest_label(dataset: datasets.Dataset) -> int:
    """Tokens of the longest ``labels`` row (``</s>`` included).

    :rtype: int
    """
    return max((len(labels) for labels in dataset["labels"]), default=0)


def bound_generation(
    model: PreTrainedModel,
    args: Seq2SeqTrainingArguments,
    eval_dataset: datasets.Dataset | None,
    margin: int = GENERATION_MARGIN,
) -> int:
    """Set ``max_new_tokens`` to the longest gold query plus ``margin``, capped by ``--generation_max_length``.

    :param model: its ``generation_config`` is changed in place.
    :param args: ``generation_max_length`` is read as a cap, then cleared, so the trainer passes no ``max_length``.
    :param eval_dataset: the evaluation split (``labels`` column); without one the cap is the bound.
    :returns: the bound.
    :rtype: int
    """
    cap = args.generation_max_length or model.generation_config.max_new_tokens
    bound = longest_label(eval_dataset) + margin if eval_dataset is not None and len(eval_dataset) else cap
    if cap:
        bound = min(bound, cap)
    if not bound:
        raise ValueError("no generation bound: pass --generation-max-length N or an evaluation split with labels")
    model.generation_config.max_new_tokens = bound
    model.generation_config.max_length = None
    args.generation_max_length = None
    logger.info("evaluation generates at most %d tokens a query", bound)
    return bound


class KeepGenerationBound(TrainerCallback):
    """Keep ``max_length`` unset in the model's generation config while the trainer evaluates.

    ``Seq2SeqTrainer.prediction_step`` fills generate's defaults into the model's config after each
    batch (``max_length`` 20), which would clash with ``max_new_tokens`` in the next batch, the next
    evaluation and the saved checkpoints and model.
    """

    def on_prediction_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            model.generation_config.max_length = None
