"""The evaluation that runs during training, with generation constrained to the WikiSQL grammar.

``Seq2SeqTrainer`` generates for each evaluation batch with the same keyword arguments; the grammar,
though, is each question's own, and a batch knows its questions only as token ids. So
:class:`GrammarSeq2SeqTrainer` builds a :class:`textsql.decoding.processor.GrammarLogitsProcessor` per batch from
its input ids (the question and header read back from the input text) and hands it to ``generate``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from textsql.decoding.processor import processor_for_inputs
from textsql.training.batching import TokenBudgetTrainer

logger = logging.getLogger(__name__)


def generation_budget(gen_kwargs: dict[str, Any], config: GenerationConfig) -> int:
    """The tokens an encoder-decoder ``generate`` call may write after the decoder's start token.

    As ``generate`` decides: ``max_new_tokens`` (call, then config) wins over ``max_length`` (call,
    then config), which counts the start token.

    :rtype: int
    """
    new_tokens = gen_kwargs.get("max_new_tokens") or config.max_new_tokens
    if new_tokens:
        return int(new_tokens)
    return int(gen_kwargs.get("max_length") or config.max_length) - 1


class GrammarSeq2SeqTrainer(TokenBudgetTrainer):
    """A ``Seq2SeqTrainer`` whose generating evaluation writes only WikiSQL queries over each question's table.

    Usage::

        >>> trainer = GrammarSeq2SeqTrainer(model=model, args=training_args, processing_class=tokenizer, ...)  # doctest: +SKIP

    :param uncased: the model writes its queries in lower case (the ``uncased`` input format).
    """

    def __init__(self, *args: Any, uncased: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.uncased = uncased

    # transformers' own Seq2SeqTrainer returns a float | None loss where Trainer declares a Tensor | None:
    # this follows its direct parent, which it calls.
    def prediction_step(  # type: ignore[override]
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[float | None, torch.Tensor | None, torch.Tensor | None]:
        if self.args.predict_with_generate and not prediction_loss_only:
            # The parent takes its stored keyword arguments only when it is given none.
            gen_kwargs = gen_kwargs or dict(getattr(self, "_gen_kwargs", {}))
            budget = generation_budget(gen_kwargs, self.model.generation_config)
            gen_kwargs["logits_processor"] = LogitsProcessorList(
                [processor_for_inputs(self.processing_class, inputs["input_ids"], budget, self.uncased)]
            )
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
