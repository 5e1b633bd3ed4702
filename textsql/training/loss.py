"""Training loss over the batch's own tokens (``--loss_vocabulary batch``), for a T5 trained from scratch.

The embedded small T5 scores all 32,128 tokens of T5's vocabulary at every target position: on a CPU that
output layer is about three quarters of a training step (0.44 s of a 16-question step on one core, 0.11 s
with the batch's tokens only). Normalising the softmax over the tokens that occur in the batch's inputs
and targets instead is a target-vocabulary subset in the manner of Jean et al. 2015 ("On Using Very Large
Target Vocabulary for Neural Machine Translation"). It asks of the model about what constrained decoding
does: the grammar lets through only the question's words, the header's column names and SQL's keywords, all
in the batch but for the other-case spellings of question words (``MANY`` for ``many``) that the grammar
also allows for values. Evaluation and generation use the full vocabulary, so evaluation losses are larger
than training losses under this choice, and free (unconstrained) decoding of such a model is not
meaningful.

``auto`` chooses ``batch`` for a model built from a config (trained from scratch, decoded with the grammar)
and ``full`` for a model with weights: a pretrained T5 keeps the loss it was pretrained with. Under ZeRO-3 the
loss is the full one whatever the choice: there the output layer's weight is partitioned across ranks and
gathered only inside that layer's own forward, which this loss does not call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import T5ForConditionalGeneration
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import CONFIG_NAME

from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.model import builds_from_config


def resolve_loss_vocabulary(choice: str, model: str | Path | None) -> str:
    """``full`` or ``batch``: what ``auto`` means for ``model`` (see the module's text), else ``choice`` itself.

    :param choice: ``auto``, ``full`` or ``batch`` (``--loss_vocabulary``).
    :param model: the model to train, as ``--model`` names it.
    :rtype: str
    """
    if choice != "auto":
        return choice
    return "batch" if builds_from_config(model) else "full"


def batch_vocabulary_loss(
    hidden: torch.Tensor, output_weight: torch.Tensor, labels: torch.Tensor, input_ids: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of ``labels`` with the softmax over the tokens of ``input_ids`` and ``labels`` only.

    :param hidden: decoder outputs as the output layer takes them, ``(batch, target_length, d_model)``.
    :param output_weight: the output layer's weight, ``(vocabulary, d_model)``.
    :param labels: target ids, :data:`LABEL_PAD_TOKEN_ID` where padded.
    :param input_ids: the encoder's input ids.
    :rtype: torch.Tensor
    """
    kept = labels != LABEL_PAD_TOKEN_ID
    # Sorted, so each target's column is found by binary search.
    vocabulary = torch.unique(torch.cat([input_ids.flatten(), labels[kept]]))
    logits = hidden @ output_weight[vocabulary].T
    columns = torch.searchsorted(vocabulary, labels.clamp(min=0))
    targets = torch.where(kept, columns, LABEL_PAD_TOKEN_ID)
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=LABEL_PAD_TOKEN_ID
    )


class BatchVocabularyT5(T5ForConditionalGeneration):
    """T5 whose training forward computes :func:`batch_vocabulary_loss` and no full logits; in evaluation mode,
    or without labels, it is T5 as transformers writes it. Its weights load into ``T5ForConditionalGeneration``."""

    @property
    def loss_vocabulary(self) -> str:
        """``batch``, or ``full`` where ZeRO-3 has partitioned the output layer's weight (see the module's text)."""
        return "full" if hasattr(self.lm_head.weight, "ds_id") else "batch"

    def save_pretrained(  # type: ignore[override]  # the arguments after these pass through as keywords
        self, save_directory: str | Path, is_main_process: bool = True, **kwargs: Any
    ) -> None:
        """transformers' save, naming ``T5ForConditionalGeneration`` as the saved model's architecture: the loss is
        training's alone, and what reads a model's class from its config (the Hub, serving engines) knows T5's."""
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        config = Path(save_directory) / CONFIG_NAME
        if is_main_process and config.is_file():
            saved = json.loads(config.read_text(encoding="utf-8"))
            saved["architectures"] = [T5ForConditionalGeneration.__name__]
            config.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Seq2SeqLMOutput:
        if (
            not self.training
            or labels is None
            or input_ids is None
            or kwargs.get("encoder_outputs") is not None
            or self.loss_vocabulary == "full"
        ):
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                labels=labels,
                **kwargs,
            )
        encoded = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden = self.decoder(
            input_ids=self._shift_right(labels) if decoder_input_ids is None else decoder_input_ids,
            attention_mask=kwargs.get("decoder_attention_mask"),
            encoder_hidden_states=encoded,
            encoder_attention_mask=attention_mask,
            use_cache=False,
        ).last_hidden_state
        if self.config.scale_decoder_outputs:
            hidden = hidden * self.model_dim**-0.5
        return Seq2SeqLMOutput(loss=batch_vocabulary_loss(hidden, self.lm_head.weight, labels, input_ids))
