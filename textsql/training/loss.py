"""T5's training loss computed from the decoder's outputs without T5's full logits.

T5 as transformers writes it computes the logits of every target position over all 32,128 tokens of its
vocabulary, upcasts them to fp32 for the cross-entropy and keeps them for the backward, several copies of the
largest tensors of a step, each written and read again: on t5-small's shape at 2,048 target positions, they raised
a CPU step's peak memory from 2,411 MiB to 3,033 (``bench/sliced_loss.json``).
:class:`TrainingLossT5` computes the same loss in one of two ways instead, by ``--loss_vocabulary``.

**Full vocabulary** (``full``, what a pretrained T5 trains with): torch's own
``torch.nn.functional.linear_cross_entropy`` (torch 2.13 and later), which computes the output layer and the
cross-entropy a slice of target positions at a time, the gradients within the same pass, so the logits of only one
slice exist at once. :func:`full_vocabulary_loss` cuts a batch into :data:`LOSS_CHUNKS` slices rather than
torch's own choice, which sizes a slice from the layer's input (64 slices a step on t5-small's and t5-base's
shapes). Each slice reads the whole output weight again and adds to its whole gradient: on t5-small's shape torch's
64 made a step slower than T5's own with the logits, where four did not. Below ``d_model`` target positions a
batch's logits are small, and it is computed in one piece, as transformers does.

**Batch vocabulary** (``batch``), for a T5 trained from scratch.

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
and ``full`` for a model with weights: a pretrained T5 keeps the loss it was pretrained with.

Under ZeRO-3, and for the full vocabulary on a torch without ``linear_cross_entropy``, a step computes T5's full
logits through the output layer's own forward and T5's cross-entropy over them (:attr:`TrainingLossT5.full_logits`):
ZeRO-3 partitions the output layer's weight across ranks and gathers it only inside that layer's forward, which the
other losses do not call.

Every training step passes T5 its padding mask ready-made (:func:`key_padding_mask`), which spares it two host
syncs a step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from transformers import T5ForConditionalGeneration
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import CONFIG_NAME

from textsql.constants import LABEL_PAD_TOKEN_ID
from textsql.model import builds_from_config, load_model

# Slices of a batch's target positions the full-vocabulary loss is computed in (see the module's text).
LOSS_CHUNKS = 4


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


def full_vocabulary_loss(hidden: torch.Tensor, output_weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``labels`` over the whole vocabulary, T5's own loss, without the full logits: in
    :data:`LOSS_CHUNKS` slices of target positions where there are at least ``d_model`` of them, else in one.

    Under autocast the output layer runs in autocast's precision, as T5's ``lm_head`` does there: torch's chunked
    operator is not on autocast's list and would otherwise multiply in fp32.

    :param hidden: decoder outputs as the output layer takes them, ``(batch, target_length, d_model)``.
    :param output_weight: the output layer's weight, ``(vocabulary, d_model)``.
    :param labels: target ids, :data:`LABEL_PAD_TOKEN_ID` where padded.
    :rtype: torch.Tensor
    """
    hidden, output_weight = in_autocast_precision(hidden, output_weight)
    positions = labels.numel()
    options = (
        torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=-(-positions // LOSS_CHUNKS))
        if positions >= hidden.shape[-1]
        else None
    )
    return torch.nn.functional.linear_cross_entropy(
        hidden.flatten(0, 1), output_weight, labels.flatten(), ignore_index=LABEL_PAD_TOKEN_ID, options=options
    )


def key_padding_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A batch's 2D padding mask as the 4D mask T5's attention adds to its scores: 0 where a key is a token, the
    dtype's lowest value where it is padding, broadcast over heads and queries.

    Given the 2D mask, transformers builds this itself, but first reads on the host whether the batch has any padding
    at all (``padding_mask.all()`` in ``masking_utils``), so as to drop the mask for flash attention, which T5's
    position bias rules out anyway: once for the encoder and once for the cross-attention, every step, each a host
    sync that waits for the GPU to finish all it was given. A 4D mask transformers takes as it is.

    :rtype: torch.Tensor | None
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    padding = attention_mask[:, None, None, :] == 0
    mask = torch.zeros(padding.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill_(padding, torch.finfo(dtype).min)


def in_autocast_precision(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` cast to autocast's precision where autocast is on for their device, else as they are.

    :rtype: tuple[torch.Tensor, ...]
    """
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    return tuple(tensor.to(torch.get_autocast_dtype(device)) for tensor in tensors)


def training_model(model: str | Path | None, loss_vocabulary: str) -> TrainingLossT5:
    """``model`` (as :func:`textsql.model.load_model` takes it) as a :class:`TrainingLossT5` training
    ``loss_vocabulary`` (``full`` or ``batch``).

    :rtype: TrainingLossT5
    """
    loaded = cast(TrainingLossT5, load_model(model, model_class=TrainingLossT5))
    loaded.vocabulary = loss_vocabulary
    return loaded


class TrainingLossT5(T5ForConditionalGeneration):
    """T5 whose training forward computes :func:`full_vocabulary_loss` or :func:`batch_vocabulary_loss`, by
    :attr:`vocabulary`, and no full logits (where :attr:`full_logits`, T5's logits and loss), its padding mask given
    ready-made; in evaluation mode or without labels, it is T5 as transformers writes it. Its weights load into
    ``T5ForConditionalGeneration``."""

    #: ``full`` or ``batch``: the loss asked for (:func:`training_model` sets it).
    vocabulary = "full"

    @property
    def loss_vocabulary(self) -> str:
        """:attr:`vocabulary`, but ``full`` where ZeRO-3 has partitioned the output layer's weight."""
        return "full" if self._output_partitioned else self.vocabulary

    @property
    def full_logits(self) -> bool:
        """Whether a training step computes T5's logits over the whole vocabulary (see the module's text)."""
        return self._output_partitioned or (
            self.vocabulary == "full" and not hasattr(torch.nn.functional, "linear_cross_entropy")
        )

    @property
    def _output_partitioned(self) -> bool:
        return hasattr(self.lm_head.weight, "ds_id")

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
        if not self.training or labels is None or input_ids is None or kwargs.get("encoder_outputs") is not None:
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                labels=labels,
                **kwargs,
            )
        hidden = self.output_layer_inputs(
            input_ids, attention_mask, labels, decoder_input_ids, kwargs.get("decoder_attention_mask")
        )
        if self.full_logits:
            # Through the output layer's own forward, which ZeRO-3 gathers the partitioned weight for, as T5 does.
            logits = self.lm_head(hidden)
            loss = torch.nn.functional.cross_entropy(
                logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=LABEL_PAD_TOKEN_ID
            )
            return Seq2SeqLMOutput(loss=loss, logits=logits)
        if self.vocabulary == "batch":
            return Seq2SeqLMOutput(loss=batch_vocabulary_loss(hidden, self.lm_head.weight, labels, input_ids))
        return Seq2SeqLMOutput(loss=full_vocabulary_loss(hidden, self.lm_head.weight, labels))

    def output_layer_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's outputs as T5's output layer takes them (scaled where T5 scales them), teacher-forced on
        ``labels``: what both losses start from.

        :rtype: torch.Tensor
        """
        keys = key_padding_mask(attention_mask, self.dtype)
        encoded = self.encoder(input_ids=input_ids, attention_mask=keys).last_hidden_state
        hidden = self.decoder(
            input_ids=self._shift_right(labels) if decoder_input_ids is None else decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoded,
            encoder_attention_mask=keys,
            use_cache=False,
        ).last_hidden_state
        return hidden * self.model_dim**-0.5 if self.config.scale_decoder_outputs else hidden
